package daemon

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rbd-nbd-go/rbd-nbd-go/attach"
	"github.com/rbd-nbd-go/rbd-nbd-go/control"
	"github.com/rbd-nbd-go/rbd-nbd-go/internal/unixsock"
)

// The handover between an old daemon and a new one (an upgrade: the new
// node-plugin pod starts while the old one still runs). It runs over a
// SOCK_SEQPACKET socket in the state directory, one JSON message per
// packet, descriptors passed with SCM_RIGHTS:
//
//	new → old  list                            (first, on its own connection)
//	old → new  devices {devices}               (nothing paused: the new one
//	                                            opens their images ahead)
//	new → old  take {pid}
//	old → new  refused {why}                  (the old one serves on)
//	        or header {devices} + [state lock, control socket, handover socket]
//	           one packet per served device   + its socket ends
//	new → old  done {adopted, failed}
//
// The old daemon sends only after every device is paused, answered,
// flushed and its image's lock released; it closes the images once the
// new one said done (or broke off). The state lock travels as a descriptor
// (flock belongs to the open file), so there is never a moment without
// an owner, nor with two; the control socket too, so clients never find
// nobody there. A refusal or a failure before the header leaves the old
// daemon serving; after it, a device the new one cannot open falls back
// to the ordinary reattach.

// HandoverSocket is the handover socket's path in a state directory.
func HandoverSocket(stateDir string) string { return filepath.Join(stateDir, "handover.sock") }

const (
	// pauseWait bounds the old daemon's pause: a request stuck in the
	// backend past it makes the old daemon refuse and serve on.
	pauseWait = 10 * time.Second
	// gateWait bounds the wait for control requests in flight (a map
	// opening an image) before the pause.
	gateWait = 10 * time.Second
	// takeWait bounds the new daemon's wait for the header.
	takeWait = pauseWait + gateWait + 10*time.Second
	// doneWait bounds the old daemon's wait for the new one's result,
	// which it only logs: it has nothing left to serve.
	doneWait = 2 * time.Minute
	// maxPacket bounds one message (a header lists every device).
	maxPacket = 1 << 20
	// fdsPerPacket stays under the kernel's SCM_MAX_FD (253).
	fdsPerPacket = 200
)

type handoverMsg struct {
	Op      string           `json:"op"`
	PID     int              `json:"pid,omitempty"`
	Why     string           `json:"why,omitempty"`
	Devices []control.Record `json:"devices,omitempty"`
	Follow  []int            `json:"follow,omitempty"` // devices whose packets follow the header
	Index   int              `json:"index,omitempty"`
	Conns   int              `json:"conns,omitempty"`
	Adopted int              `json:"adopted,omitempty"`
	Failed  []string         `json:"failed,omitempty"`
	// Paused (in a header) is when the old daemon stopped reading new
	// requests: the new one logs how long the kernel's sockets went
	// unread, the handover's own share of an upgrade's I/O stall.
	Paused time.Time `json:"paused,omitzero"`
}

// sendMsg sends one packet with files attached.
func sendMsg(c *net.UnixConn, m handoverMsg, files ...*os.File) error {
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	var oob []byte
	if len(files) > 0 {
		fds := make([]int, len(files))
		for i, f := range files {
			fds[i] = int(f.Fd())
		}
		oob = unix.UnixRights(fds...)
	}
	_, _, err = c.WriteMsgUnix(b, oob, nil)
	return err
}

// recvMsg receives one packet and the files attached to it into b
// (maxPacket long, or nil for a fresh one). The new daemon passes one
// buffer, made before it asks, for every packet of a handover: not a
// megabyte allocated per device in the devices' pause.
func recvMsg(c *net.UnixConn, deadline time.Time, b []byte) (handoverMsg, []*os.File, error) {
	c.SetReadDeadline(deadline)
	if b == nil {
		b = make([]byte, maxPacket)
	}
	oob := make([]byte, unix.CmsgSpace(4*fdsPerPacket+16))
	n, oobn, flags, _, err := c.ReadMsgUnix(b, oob)
	if err != nil {
		return handoverMsg{}, nil, err
	}
	var files []*os.File
	if oobn > 0 {
		scms, err := unix.ParseSocketControlMessage(oob[:oobn])
		if err != nil {
			return handoverMsg{}, nil, err
		}
		for _, scm := range scms {
			fds, err := unix.ParseUnixRights(&scm)
			if err != nil {
				continue
			}
			for _, fd := range fds {
				unix.CloseOnExec(fd)
				files = append(files, os.NewFile(uintptr(fd), "handed"))
			}
		}
	}
	if flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0 {
		closeFiles(files)
		return handoverMsg{}, nil, errors.New("handover message truncated")
	}
	var m handoverMsg
	if n == 0 {
		closeFiles(files)
		return m, nil, errors.New("handover peer closed the socket")
	}
	if err := json.Unmarshal(b[:n], &m); err != nil {
		closeFiles(files)
		return m, nil, fmt.Errorf("handover message: %w", err)
	}
	return m, files, nil
}

func closeFiles(fs []*os.File) {
	for _, f := range fs {
		f.Close()
	}
}

// controlGate lets the handover wait for control requests in flight and
// turn new ones away (the client retries them, and the new daemon
// answers them).
type controlGate struct {
	mu      sync.RWMutex
	closing bool
}

// enter admits a request unless a handover holds the gate; leave after.
func (g *controlGate) enter() bool {
	g.mu.RLock()
	if g.closing {
		g.mu.RUnlock()
		return false
	}
	return true
}

func (g *controlGate) leave() { g.mu.RUnlock() }

// close waits up to wait for the requests in flight and shuts the gate.
func (g *controlGate) close(wait time.Duration) bool {
	for end := time.Now().Add(wait); ; {
		if g.mu.TryLock() {
			g.closing = true
			g.mu.Unlock()
			return true
		}
		if time.Now().After(end) {
			return false
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (g *controlGate) open() {
	g.mu.Lock()
	g.closing = false
	g.mu.Unlock()
}

// giver is what the old daemon hands over besides its devices.
type giver struct {
	m       *attach.Manager
	gate    *controlGate
	lock    *os.File
	control net.Listener
	hand    net.Listener
	fence   *fencer
	log     *slog.Logger
	// waits: gateWait and pauseWait unless set (tests).
	gateWait, pauseWait time.Duration
}

// serveHandovers answers handover requests on g.hand until ctx ends or
// one succeeds. handedOver is called as soon as the devices have left
// (it stops the daemon's control server, whose listener is the new
// daemon's now); serveHandovers returns once the new daemon reported.
func (g *giver) serveHandovers(ctx context.Context, handedOver func()) {
	stop := context.AfterFunc(ctx, func() { g.hand.Close() })
	defer stop()
	for {
		c, err := g.hand.Accept()
		if err != nil {
			return
		}
		uc, ok := c.(*net.UnixConn)
		if !ok {
			c.Close()
			continue
		}
		if g.give(uc, handedOver) {
			return
		}
	}
}

// give runs one handover from the old side; true once the devices left
// (and left called).
func (g *giver) give(c *net.UnixConn, left func()) bool {
	defer c.Close()
	req, files, err := recvMsg(c, time.Now().Add(10*time.Second), nil)
	closeFiles(files)
	if err == nil && req.Op == "list" {
		if err := sendMsg(c, handoverMsg{Op: "devices", Devices: g.m.List()}); err != nil {
			g.log.Warn("cannot send the device list", "err", err)
		}
		return false
	}
	if err != nil || req.Op != "take" {
		g.log.Warn("bad handover request", "op", req.Op, "err", err)
		return false
	}
	t0 := time.Now()
	g.log.Info("handing over to a new daemon", "pid", req.PID)
	refuse := func(why error) bool {
		g.log.Warn("handover refused; serving on", "pid", req.PID, "why", why)
		sendMsg(c, handoverMsg{Op: "refused", Why: why.Error()})
		return false
	}
	if !g.gate.close(cmp.Or(g.gateWait, gateWait)) {
		return refuse(errors.New("control requests still running"))
	}
	ctx, cancel := context.WithTimeout(context.Background(), cmp.Or(g.pauseWait, pauseWait))
	pausing := time.Now()
	h, err := g.m.HandOver(ctx)
	cancel()
	if err != nil {
		g.gate.open()
		return refuse(err)
	}
	paused := time.Since(t0)
	handed, err := h.Release()
	if err != nil {
		g.log.Warn("some backends did not close cleanly", "err", err)
	} else if err := g.fence.clean(); err != nil {
		g.log.Warn("cannot mark the sessions record clean", "err", err)
	}
	// The images' locks are free; the rest of their close waits until
	// the new daemon has reported (or the handover broke off).
	defer func() {
		t := time.Now()
		if err := h.CloseReleased(); err != nil {
			g.log.Warn("some released images did not close cleanly", "err", err)
		}
		g.log.Info("closed the released images", "took", time.Since(t).Round(time.Millisecond))
	}()
	// From here on the devices are the new daemon's, whatever happens.
	left = sync.OnceFunc(left)
	defer left()
	var own []*os.File
	defer func() { closeFiles(own) }()
	lockDup, err := dupFile(g.lock)
	if err == nil {
		own = append(own, lockDup)
	}
	ctl, err2 := unixsock.Handoff(g.control)
	if err2 == nil {
		own = append(own, ctl)
	}
	hand, err3 := unixsock.Handoff(g.hand)
	if err3 == nil {
		own = append(own, hand)
	}
	var recs []control.Record
	var follow []int
	for _, h := range handed {
		recs = append(recs, h.Rec)
		own = append(own, h.Conns...)
		if len(h.Conns) > 0 {
			follow = append(follow, h.Rec.Index)
		}
	}
	if err := errors.Join(err, err2, err3); err != nil {
		g.log.Error("handover failed after the devices were released; the next daemon reattaches them", "err", err)
		return true
	}
	if err := sendMsg(c, handoverMsg{Op: "header", Devices: recs, Follow: follow, Paused: pausing}, lockDup, ctl, hand); err != nil {
		g.log.Error("handover failed after the devices were released; the next daemon reattaches them", "err", err)
		return true
	}
	for _, h := range handed {
		if len(h.Conns) == 0 {
			continue
		}
		if err := sendMsg(c, handoverMsg{Op: "device", Index: h.Rec.Index, Conns: len(h.Conns)}, h.Conns...); err != nil {
			g.log.Error("handover failed midway; the next daemon reattaches the rest", "device", h.Rec.Device(), "err", err)
			return true
		}
	}
	sent := time.Since(t0)
	closeFiles(own) // the new daemon holds its own copies
	own = nil
	left()
	res, files, err := recvMsg(c, time.Now().Add(doneWait), nil)
	closeFiles(files)
	g.log.Info("handed over", "pid", req.PID, "devices", len(handed), "paused_after", paused.Round(time.Millisecond),
		"sent_after", sent.Round(time.Millisecond), "adopted", res.Adopted, "failed", res.Failed, "err", err)
	return true
}

// dupFile duplicates f without switching it to blocking mode (Fd would).
func dupFile(f *os.File) (*os.File, error) {
	sc, err := f.SyscallConn()
	if err != nil {
		return nil, err
	}
	var out *os.File
	var derr error
	sc.Control(func(fd uintptr) {
		var nfd int
		nfd, derr = unix.FcntlInt(fd, unix.F_DUPFD_CLOEXEC, 0)
		out = os.NewFile(uintptr(nfd), f.Name())
	})
	return out, derr
}

// taken is what the new daemon received.
type taken struct {
	conn     *net.UnixConn
	lock     *os.File
	control  net.Listener
	hand     net.Listener
	handed   []attach.Handed
	prepared *attach.Prepared // opened ahead, by ownState
	paused   time.Time        // the old daemon's last new read; zero if not sent
	received time.Time        // when the last device had arrived
}

// list asks the daemon running in stateDir which devices it serves,
// without a pause: the new daemon opens their images meanwhile.
func list(stateDir string) ([]control.Record, error) {
	c, err := net.DialTimeout("unixpacket", HandoverSocket(stateDir), 5*time.Second)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	uc := c.(*net.UnixConn)
	if err := sendMsg(uc, handoverMsg{Op: "list"}); err != nil {
		return nil, err
	}
	m, files, err := recvMsg(uc, time.Now().Add(10*time.Second), nil)
	closeFiles(files)
	if err != nil {
		return nil, err
	}
	if m.Op != "devices" {
		return nil, fmt.Errorf("the running daemon answered %q to a device list", m.Op)
	}
	return m.Devices, nil
}

// errRefused: the running daemon refused (or could not be asked); it
// serves on, and the caller uses it.
var errRefused = errors.New("handover refused")

// take asks the daemon running in stateDir for its devices. An error
// wrapping errRefused means nothing changed hands.
func take(stateDir string, log *slog.Logger) (*taken, error) {
	c, err := net.DialTimeout("unixpacket", HandoverSocket(stateDir), 5*time.Second)
	if err != nil {
		return nil, fmt.Errorf("%w: the running daemon takes no handover: %v", errRefused, err)
	}
	uc := c.(*net.UnixConn)
	buf := make([]byte, maxPacket)
	if err := sendMsg(uc, handoverMsg{Op: "take", PID: os.Getpid()}); err != nil {
		uc.Close()
		return nil, fmt.Errorf("%w: %v", errRefused, err)
	}
	hdr, files, err := recvMsg(uc, time.Now().Add(takeWait), buf)
	if err != nil || hdr.Op != "header" || len(files) != 3 {
		closeFiles(files)
		uc.Close()
		if err == nil && hdr.Op == "refused" {
			err = errors.New(hdr.Why)
		}
		// A header that did not arrive whole: the old daemon may have
		// released its devices; the kernel then sees their sockets die
		// with it, and the ordinary reattach takes them back.
		return nil, fmt.Errorf("%w: %v", errRefused, err)
	}
	t := &taken{conn: uc, lock: files[0], paused: hdr.Paused}
	files[0] = nil
	fail := func(err error) (*taken, error) {
		closeFiles(files)
		t.close()
		return nil, err
	}
	if t.control, err = unixsock.FromFile(files[1], control.SocketPath(stateDir)); err != nil {
		return fail(err)
	}
	if t.hand, err = unixsock.FromFile(files[2], HandoverSocket(stateDir)); err != nil {
		return fail(err)
	}
	closeFiles(files[1:])
	byIndex := map[int]int{}
	for _, rec := range hdr.Devices {
		byIndex[rec.Index] = len(t.handed)
		t.handed = append(t.handed, attach.Handed{Rec: rec})
	}
	for range hdr.Follow {
		m, fs, err := recvMsg(uc, time.Now().Add(takeWait), buf)
		i, ok := byIndex[m.Index]
		if err != nil || m.Op != "device" || !ok || len(fs) != m.Conns {
			closeFiles(fs)
			log.Error("handover broke off; what was not received is reattached", "err", err)
			break
		}
		t.handed[i].Conns = fs
	}
	t.received = time.Now()
	return t, nil
}

// done tells the old daemon how the adoption went and hangs up.
func (t *taken) done(adopted int, err error) {
	m := handoverMsg{Op: "done", Adopted: adopted}
	if err != nil {
		m.Failed = []string{err.Error()}
	}
	sendMsg(t.conn, m)
	t.conn.Close()
}

func (t *taken) close() {
	if t.conn != nil {
		t.conn.Close()
	}
	if t.lock != nil {
		t.lock.Close()
	}
	for _, l := range []net.Listener{t.control, t.hand} {
		if l != nil {
			l.Close()
		}
	}
	for _, h := range t.handed {
		closeFiles(h.Conns)
	}
	t.prepared.Close()
}
