package control

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// StartOptions say how to start the node daemon: this executable's
// hidden "daemon" command, in its own session, logging to LogPath.
type StartOptions struct {
	// Exe is the binary to run; empty means this executable.
	Exe      string
	LogLevel string
	// NbdsMax and MaxPart are nbd module parameters, for a daemon that
	// loads the module itself.
	NbdsMax, MaxPart int
}

// TakeOver starts a daemon from this executable that asks the running
// one, if any, to hand its devices over, and returns once it serves. The
// CSI node plugin calls it at start: a running daemon then belongs to the
// plugin pod being replaced (an upgrade, with the pods overlapping), and
// dies with it. Without a running daemon it is EnsureRunning. If the
// running one refuses (or predates handovers), it serves on and is used.
func (c *Client) TakeOver(ctx context.Context) error {
	_, err := c.takeOver(ctx)
	return err
}

// takeOver is TakeOver; crashed is closed if the daemon it started dies
// (nil if the daemon serving is not the one it started): see start.
func (c *Client) takeOver(ctx context.Context) (crashed <-chan struct{}, err error) {
	if err := c.Ping(ctx); err != nil {
		if !absent(err) {
			return nil, err
		}
		return c.start(ctx, false)
	}
	return c.start(ctx, true)
}

// Ready-pipe words: a daemon writes ReadyOK once it serves, or
// ReadyRunning when another daemon already holds the state directory,
// or any other line saying why it stopped.
const (
	ReadyOK      = "ok"
	ReadyRunning = "running"
)

// readyWait bounds the wait for a starting daemon: it reattaches every
// recorded device before it answers.
const readyWait = 3 * time.Minute

// EnsureRunning starts the daemon unless one answers; it returns once
// the daemon serves. The CSI node plugin calls it at start, so a
// restarted plugin's devices get their server back before the kernel's
// dead-connection timeout, without waiting for a first request.
func (c *Client) EnsureRunning(ctx context.Context) error {
	_, err := c.ensureRunning(ctx)
	return err
}

// ensureRunning is EnsureRunning; crashed as takeOver's.
func (c *Client) ensureRunning(ctx context.Context) (crashed <-chan struct{}, err error) {
	err = c.Ping(ctx)
	if err == nil || !absent(err) {
		return nil, err
	}
	return c.start(ctx, false)
}

// PluginDaemon is a CSI node plugin's hold on the node daemon: taken
// over (or started) when the plugin starts, started again whenever it
// stops answering, and, when the plugin stops, kept serving until a
// newer daemon has taken its devices over.
type PluginDaemon struct {
	c    *Client
	mine atomic.Value // string: the instance this plugin started
	pid  atomic.Int64 // and its pid
	// crashed is closed when the daemon this plugin started dies (nil
	// if the one serving is not its child), and started is when that
	// start was. Start and Supervise only, which run one after the
	// other.
	crashed <-chan struct{}
	started time.Time
}

// NewPluginDaemon is the plugin's hold on c's daemon, before Start.
func (c *Client) NewPluginDaemon() *PluginDaemon {
	p := &PluginDaemon{c: c}
	p.mine.Store("")
	return p
}

// Start is TakeOver, remembering which daemon is the plugin's.
func (p *PluginDaemon) Start(ctx context.Context) error {
	crashed, err := p.c.takeOver(ctx)
	if err == nil {
		p.remember(ctx)
		p.crashed, p.started = crashed, time.Now()
	}
	return err
}

func (p *PluginDaemon) remember(ctx context.Context) {
	if resp, err := p.c.call(ctx, Request{Op: OpPing}); err == nil {
		p.mine.Store(resp.Instance)
		p.pid.Store(int64(resp.PID))
	}
}

// Supervise starts the daemon again whenever it stops answering (a kill,
// a crash), checking every interval until ctx ends: its devices' I/O
// waits for it meanwhile. A daemon started on demand would come only with
// the next request, and the kernel fails I/O after the reattach timeout.
// The plugin's own child is checked the moment it dies (a signal, a
// non-zero exit), not at the next tick: a kill -9's stall would wait half
// an interval on average. Not if it had served for less than an interval
// (a daemon that dies at once keeps to the interval and its backoff), nor
// after a clean exit: a daemon that handed its devices over exits 0, and
// if that handover broke off the new daemon must find the state directory
// free, not taken by one this plugin started in a hurry.
// A daemon that will not start (no NBD in this kernel) is tried again
// after a wait that doubles up to maxRestartWait, so a plugin on a node
// that cannot serve does not spawn a process a second. log hears of each
// start: err nil when it serves again.
func (p *PluginDaemon) Supervise(ctx context.Context, interval time.Duration, log func(err error)) {
	wait := interval
	t := time.NewTimer(wait)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-p.crashed:
			p.crashed = nil
			if time.Since(p.started) < interval {
				continue // the timer is still set
			}
			t.Stop()
		}
		err := p.c.Ping(ctx)
		if err == nil || !absent(err) {
			wait = interval
			t.Reset(wait)
			continue
		}
		// Gone: its crash, if the tick came first, is no second reason to
		// start one (a failed start keeps its backoff).
		p.crashed = nil
		crashed, err := p.c.ensureRunning(ctx)
		if err == nil {
			p.remember(ctx)
			p.crashed, p.started = crashed, time.Now()
			wait = interval
		} else {
			wait = min(2*wait, max(interval, maxRestartWait))
		}
		if ctx.Err() == nil {
			log(err)
		}
		t.Reset(wait)
	}
}

// maxRestartWait bounds the wait between tries to start a daemon that
// would not start.
const maxRestartWait = time.Minute

// Release waits, up to wait, for the plugin's daemon to be taken over or
// gone. A stopped plugin's daemon dies with its pod. In an upgrade the
// new pod may count as started before its daemon took over (its probes
// share the old pod's port and CSI socket), and the DaemonSet then stops
// the old pod: waiting here keeps the devices served until the handover,
// instead of dropping their sockets. It reports whether it was taken over.
func (p *PluginDaemon) Release(wait time.Duration) bool {
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	mine, _ := p.mine.Load().(string)
	if mine == "" || p.c.WaitTakenOver(ctx, mine) != nil {
		return false
	}
	// A daemon that handed over closes its images once the new one has
	// them (only their locks had to go first): let it finish, rather
	// than be killed with this pod and leave their watches to time out.
	waitGone(ctx, int(p.pid.Load()))
	return true
}

// waitGone waits, until ctx ends, for process pid to exit. The plugin's
// daemon is its child, reaped by the goroutine that started it.
func waitGone(ctx context.Context, pid int) {
	for pid > 0 && syscall.Kill(pid, 0) == nil {
		select {
		case <-ctx.Done():
			return
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// start runs the daemon and waits until it serves (or says why not);
// crashed is closed if the daemon it ran, once serving, dies by a signal
// or exits non-zero. A clean exit (a SIGTERM, or devices handed to a
// newer daemon) never closes it.
func (cl *Client) start(ctx context.Context, takeOver bool) (crashed <-chan struct{}, err error) {
	o, stateDir := cl.Start, cl.StateDir
	if err := os.MkdirAll(stateDir, 0o700); err != nil {
		return nil, err
	}
	exe := o.Exe
	if exe == "" {
		var err error
		if exe, err = os.Executable(); err != nil {
			return nil, err
		}
	}
	logf, err := os.OpenFile(LogPath(stateDir), os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	pr, pw, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer pr.Close()
	level := o.LogLevel
	if level == "" {
		level = "info"
	}
	args := []string{"daemon", "--state-dir", stateDir, "--log-level", level,
		"--nbds_max", strconv.Itoa(o.NbdsMax), "--max_part", strconv.Itoa(o.MaxPart), "--ready-fd", "3"}
	if takeOver {
		args = append(args, "--take-over")
	}
	cmd := exec.Command(exe, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.ExtraFiles = []*os.File{pw}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	cmd.Dir = "/"
	err = startFlusher(cmd)
	pw.Close()
	if err != nil {
		return nil, fmt.Errorf("start daemon: %w", err)
	}
	waited, died := make(chan struct{}), make(chan struct{})
	go func() {
		if cmd.Wait() != nil {
			close(died)
		}
		close(waited)
	}()
	deadline := time.Now().Add(readyWait)
	if dl, ok := ctx.Deadline(); ok && dl.Before(deadline) {
		deadline = dl
	}
	pr.SetReadDeadline(deadline)
	line, _ := bufio.NewReader(pr).ReadString('\n')
	switch line = strings.TrimSpace(line); line {
	case ReadyOK:
		return died, nil
	case ReadyRunning:
		// Lost a start race: the winner may still be restoring. Or the
		// daemon we were to take over from died meanwhile: then nobody
		// holds the state directory, and we start one.
		err := cl.waitSocket(ctx, deadline)
		if errors.Is(err, errNoHolder) {
			return cl.start(ctx, false)
		}
		return nil, err
	case "":
		select {
		case <-waited:
			return nil, fmt.Errorf("the rbd-nbd-go daemon exited at start (see %s)", LogPath(stateDir))
		default:
			return nil, fmt.Errorf("the rbd-nbd-go daemon did not get ready (see %s)", LogPath(stateDir))
		}
	}
	return nil, errors.New(line)
}

// errNoHolder: no daemon holds the state directory's lock.
var errNoHolder = errors.New("no daemon holds the state directory")

// waitSocket waits for another starting daemon to answer; errNoHolder
// if the state directory's lock is free (it died).
func (cl *Client) waitSocket(ctx context.Context, deadline time.Time) error {
	for time.Now().Before(deadline) {
		if err := cl.Ping(ctx); err == nil {
			return nil
		}
		if lockFree(cl.StateDir) {
			return errNoHolder
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	return errors.New("another rbd-nbd-go daemon holds the state directory but does not answer")
}

// lockFree reports whether no daemon holds dir's daemon lock (flock, as
// daemon.lockState takes it); it takes and drops the lock to find out.
func lockFree(dir string) bool {
	f, err := os.OpenFile(filepath.Join(dir, "daemon.lock"), os.O_RDWR, 0)
	if err != nil {
		return false // no lock file yet: a daemon is starting
	}
	defer f.Close()
	if unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB) != nil {
		return false
	}
	unix.Flock(int(f.Fd()), unix.LOCK_UN)
	return true
}

// PR_SET_IO_FLUSHER: the daemon's allocations must not wait on writeback
// to the devices it serves.
const (
	PrSetIOFlusher = 57
	PrGetIOFlusher = 58
)

// startFlusher starts cmd from a thread marked PR_SET_IO_FLUSHER, so the
// process inherits the mark on every thread it will have (the mark is
// inherited by new threads and kept across exec). The thread is thrown
// away afterwards (never unlocked).
//
// It also turns transparent huge pages off, which the daemon does too
// (see daemon.protectFromReclaim), so that it holds from the daemon's
// first instruction: librados' static constructors and Go's first
// arena run before main. That setting is the whole process's, so this
// caller (a short-lived CLI, the CSI node plugin) gets it as well,
// which costs them nothing.
func startFlusher(cmd *exec.Cmd) error {
	unix.Prctl(unix.PR_SET_THP_DISABLE, 1, 0, 0, 0) // best effort; the daemon sets it again
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		unix.Prctl(PrSetIOFlusher, 1, 0, 0, 0) // the daemon reports if this failed
		errc <- cmd.Start()
	}()
	return <-errc
}
