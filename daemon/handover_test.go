package daemon

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/attach"
	"github.com/rbd-nbd-go/rbd-nbd-go/control"
	"github.com/rbd-nbd-go/rbd-nbd-go/internal/unixsock"
)

// kernelIO does one NBD request on a kernel-side socket, as nbd.c would.
func kernelIO(t *testing.T, s *os.File, cmd uint16, handle, off uint64, n uint32, data []byte) []byte {
	t.Helper()
	var h [28]byte
	binary.BigEndian.PutUint32(h[0:], 0x25609513)
	binary.BigEndian.PutUint16(h[6:], cmd)
	binary.BigEndian.PutUint64(h[8:], handle)
	binary.BigEndian.PutUint64(h[16:], off)
	binary.BigEndian.PutUint32(h[24:], n)
	if _, err := s.Write(append(h[:], data...)); err != nil {
		t.Fatal(err)
	}
	s.SetReadDeadline(time.Now().Add(10 * time.Second))
	var r [16]byte
	if _, err := io.ReadFull(s, r[:]); err != nil {
		t.Fatalf("reply: %v", err)
	}
	if binary.BigEndian.Uint64(r[8:]) != handle || binary.BigEndian.Uint32(r[4:]) != 0 {
		t.Fatalf("reply %x", r)
	}
	if cmd != 0 {
		return nil
	}
	out := make([]byte, n)
	if _, err := io.ReadFull(s, out); err != nil {
		t.Fatal(err)
	}
	return out
}

// oldDaemon is a daemon's serving half over dir: a manager with one
// file-backed device of two connections, the state lock, the control
// and handover sockets, and a giver serving handovers.
type oldDaemon struct {
	k      *fakeKernel
	m      *attach.Manager
	g      *giver
	handed chan struct{}
	cancel context.CancelFunc
}

func startOld(t *testing.T, dir string) *oldDaemon {
	store, err := attach.OpenStore(dir)
	if err != nil {
		t.Fatal(err)
	}
	k := &fakeKernel{socks: map[int][]*os.File{}}
	m := attach.NewManager(attach.Config{Kernel: k, Store: store, SysBlock: filepath.Join(dir, "sys"), Dev: filepath.Join(dir, "dev")})
	img := filepath.Join(dir, "disk.img")
	os.WriteFile(img, make([]byte, 1<<20), 0o600)
	if _, err := m.Map(control.Record{Index: control.AnyIndex, Spec: "file:" + img, Cookie: "c1",
		MapOptions: control.MapOptions{Connections: 2}}); err != nil {
		t.Fatal(err)
	}
	lock, err := lockState(dir)
	if err != nil || lock == nil {
		t.Fatalf("state lock: %v", err)
	}
	l, err := unixsock.Listen(control.SocketPath(dir))
	if err != nil {
		t.Fatal(err)
	}
	hl, err := unixsock.ListenSeqpacket(HandoverSocket(dir))
	if err != nil {
		t.Fatal(err)
	}
	fence, err := newFencer(dir, selfProcess(), procAlive, time.Now, quiet)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	o := &oldDaemon{k: k, m: m, handed: make(chan struct{}), cancel: cancel,
		g: &giver{m: m, gate: &controlGate{}, lock: lock, control: l, hand: hl, fence: fence, log: quiet,
			gateWait: 200 * time.Millisecond}}
	go o.g.serveHandovers(ctx, func() { close(o.handed); cancel() })
	go serve(ctx, l, m, quiet, nil, o.g.gate, "old")
	t.Cleanup(func() { cancel(); lock.Close(); m.Close() })
	return o
}

// TestHandoverBetweenDaemons runs the whole protocol over the state
// directory's socket: the new side gets the state lock, the control and
// handover sockets and the device's live kernel sockets, adopts the
// device, and the kernel's next requests are answered without it ever
// seeing a socket change.
func TestHandoverBetweenDaemons(t *testing.T) {
	dir := t.TempDir()
	old := startOld(t, dir)
	socks := old.k.socks[0]
	data := bytes.Repeat([]byte("daemon!!"), 512)
	kernelIO(t, socks[0], 1, 1, 4096, 4096, data)

	// First the list, with nothing paused: the new side opens the
	// device's backend ahead while the old one serves on.
	recs, err := list(dir)
	if err != nil || len(recs) != 1 || recs[0].Cookie != "c1" {
		t.Fatalf("list: %+v %v", recs, err)
	}
	kernelIO(t, socks[1], 0, 9, 4096, 4096, nil)
	store, _ := attach.OpenStore(dir)
	m2 := attach.NewManager(attach.Config{Kernel: old.k, Store: store, SysBlock: filepath.Join(dir, "sys"), Dev: filepath.Join(dir, "dev")})
	defer m2.Close()
	prep := m2.Prepare(recs)

	asked := time.Now()
	tk, err := take(dir, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer tk.close()
	// When the old daemon stopped reading came along: the new one logs
	// how long the sockets went unread.
	if tk.paused.Before(asked) || tk.paused.After(time.Now()) {
		t.Fatalf("paused at %v, not within the take (%v, now)", tk.paused, asked)
	}
	if len(tk.handed) != 1 || len(tk.handed[0].Conns) != 2 || tk.handed[0].Rec.Cookie != "c1" {
		t.Fatalf("handed %+v", tk.handed)
	}
	// The state lock came with it: it stays held once the old daemon's
	// copy is closed.
	old.g.lock.Close()
	if l, err := lockState(dir); err != nil || l != nil {
		t.Fatalf("the state lock is free after the handover (%v)", err)
	}
	if err := m2.Adopt(tk.handed, prep); err != nil {
		t.Fatal(err)
	}
	tk.handed = nil
	tk.done(1, nil)
	select {
	case <-old.handed:
	case <-time.After(10 * time.Second):
		t.Fatal("the old daemon did not finish the handover")
	}
	if got := kernelIO(t, socks[1], 0, 2, 4096, 4096, nil); !bytes.Equal(got, data) {
		t.Fatal("read after the handover differs")
	}
	// The control socket came too, and its path stayed: clients reach
	// the new daemon there.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go serve(ctx, tk.control, m2, quiet, nil, &controlGate{}, "new")
	c := &control.Client{StateDir: dir}
	ls, err := c.List(ctx)
	if err != nil || len(ls.Devices) != 1 {
		t.Fatalf("list through the handed control socket: %+v %v", ls, err)
	}
}

// TestHandoverRefusedWhileBusy: with a control request in flight past
// the gate's wait, the old daemon refuses, serves on, and answers the
// request; a later handover goes through.
func TestHandoverRefusedWhileBusy(t *testing.T) {
	dir := t.TempDir()
	old := startOld(t, dir)
	if !old.g.gate.enter() { // a map, say, still opening its image
		t.Fatal("gate closed")
	}
	_, err := take(dir, quiet)
	if !errors.Is(err, errRefused) {
		t.Fatalf("take while busy: %v", err)
	}
	old.g.gate.leave()
	kernelIO(t, old.k.socks[0][0], 0, 1, 0, 4096, nil) // served on
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if ls, err := (&control.Client{StateDir: dir}).List(ctx); err != nil || len(ls.Devices) != 1 {
		t.Fatalf("the old daemon after a refusal: %+v %v", ls, err)
	}
	tk, err := take(dir, quiet)
	if err != nil {
		t.Fatalf("take once idle: %v", err)
	}
	tk.done(0, errors.New("test ends here"))
	tk.close()
}

// TestControlGate: requests in flight hold the handover back; once the
// gate is shut, requests are turned away until it opens again.
func TestControlGate(t *testing.T) {
	var g controlGate
	if !g.enter() {
		t.Fatal("closed at start")
	}
	if g.close(50 * time.Millisecond) {
		t.Fatal("shut with a request in flight")
	}
	g.leave()
	if !g.close(time.Second) || g.enter() {
		t.Fatal("not shut once idle")
	}
	g.open()
	if !g.enter() {
		t.Fatal("still shut after open")
	}
	g.leave()
}
