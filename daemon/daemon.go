// Package daemon is the node daemon: one long-lived process serving
// every /dev/nbdX of the node. It holds the state directory's lock,
// protects itself from memory-reclaim deadlocks, takes back every
// recorded device (attach.Manager.Restore) before it answers, and
// serves the control API (package control) on its socket.
package daemon

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"runtime/pprof"
	"strconv"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rbd-nbd-go/rbd-nbd-go/attach"
	"github.com/rbd-nbd-go/rbd-nbd-go/control"
	"github.com/rbd-nbd-go/rbd-nbd-go/internal/sysmon"
	"github.com/rbd-nbd-go/rbd-nbd-go/internal/unixsock"
	"github.com/rbd-nbd-go/rbd-nbd-go/kernel"
	"github.com/rbd-nbd-go/rbd-nbd-go/metrics"
	"github.com/rbd-nbd-go/rbd-nbd-go/rbdio"
)

// Config is everything the daemon takes; cmd/ only fills it.
type Config struct {
	StateDir string
	Module   kernel.ModuleOptions
	Log      *slog.Logger
	// Ready gets one line once the daemon serves (control.ReadyOK),
	// or control.ReadyRunning if another daemon holds the state
	// directory, or why it stopped; then it is closed. May be nil.
	Ready io.WriteCloser
	// KernelInterface "ioctl" forces the ioctl fallback on a kernel
	// that has netlink (tests); empty picks netlink when it is there.
	KernelInterface string
	// CPUProfile, if set, profiles the daemon until it stops
	// (development).
	CPUProfile string
	// MetricsAddress, if set, serves the devices' Prometheus metrics
	// there (metrics.Address: loopback unless a host is given).
	MetricsAddress string
	// MemoryBudget bounds payload bytes in flight over every device
	// (attach.Config.MemoryBudget).
	MemoryBudget int
	// TakeOver: if another daemon holds the state directory, ask it to
	// hand its devices over (an upgrade) instead of using it.
	TakeOver bool
	// IdleProcs is the scheduler's width while no device is served
	// (procs); 0 means one P per CPU. The width while serving is the
	// GOMAXPROCS the daemon starts with.
	IdleProcs int
}

// Run serves until ctx ends. A daemon that finds another one holding
// the state directory reports control.ReadyRunning and returns nil.
// Devices stay in the kernel when it returns: the next daemon
// reattaches them.
func Run(ctx context.Context, cfg Config) (err error) {
	log := cfg.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	logStart(log)
	ready := cfg.Ready
	if ready == nil {
		ready = nopCloser{io.Discard}
	}
	readied := false
	defer func() {
		// Logged before the starter hears of it, so its "see
		// daemon.log" is never ahead of the log.
		if err != nil {
			log.Error("daemon stopped", "err", err)
		}
		if !readied {
			if err != nil {
				fmt.Fprintf(ready, "%s\n", err)
			}
			ready.Close()
		}
	}()
	// Before the images open ahead of a handover, not in its pause:
	// mlockall walks every mapping there is, up to 200 ms of the
	// devices' wait with eight images open on a TCG VM.
	protectFromReclaim(log)
	sysmon.Setup(log)
	// The manager exists before the state directory is ours, so that a
	// handover can open the images ahead (sessions wait for the fencer).
	ctl, err := openKernel(cfg)
	if err != nil {
		return err
	}
	defer ctl.Close()
	sessions := &earlySessions{}
	clusters := rbdio.NewClustersWith(sessions.hooks())
	m, err := newManager(cfg, ctl, clusters, log)
	if err != nil {
		return err
	}
	lock, tk, err := ownState(cfg, m, log)
	if err != nil || lock == nil {
		if err == nil {
			fmt.Fprintln(ready, control.ReadyRunning)
		}
		return err
	}
	defer lock.Close()
	if tk != nil {
		defer tk.close() // what was not adopted: the kernel sees it die
	}
	if stopProfile := startCPUProfile(cfg.CPUProfile); stopProfile != nil {
		defer stopProfile()
	}
	fence, err := newFencer(cfg.StateDir, selfProcess(), procAlive, time.Now, log)
	if err != nil {
		return fmt.Errorf("sessions record: %w", err)
	}
	sessions.attach(fence)
	l, hl, err := takeBack(cfg, m, tk, log)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var handedOver atomic.Bool
	g := &giver{m: m, gate: &controlGate{}, lock: lock, control: l, hand: hl, fence: fence, log: log}
	giving := make(chan struct{})
	go func() {
		defer close(giving)
		g.serveHandovers(ctx, func() { handedOver.Store(true); cancel() })
	}()
	sched := startBackground(ctx, cfg, ctl, m, log)
	if cfg.MetricsAddress != "" {
		go metrics.ServeRetrying(ctx, cfg.MetricsAddress, metrics.NewRegistry(deviceMetrics(m), connMetrics(clusters)), log)
	}
	log.Info("serving NBD devices", "pid", os.Getpid(), "kernel", ctl.Name(), "state", cfg.StateDir,
		"devices", len(m.List()))
	fmt.Fprintln(ready, control.ReadyOK)
	ready.Close()
	readied = true
	serr := serve(ctx, l, m, log, sched.serving, g.gate, newInstance())
	if handedOver.Load() {
		<-giving // the new daemon's report, logged
		log.Info("handed every device over to the new daemon; exiting")
		return nil
	}
	return errors.Join(serr, stop(m, fence, log))
}

// stop ends serving; the devices stay in the kernel for the next daemon.
func stop(m *attach.Manager, fence *fencer, log *slog.Logger) error {
	log.Info("stopping; devices stay mapped for the next daemon")
	err := m.Close()
	if err == nil {
		// Every image closed, every lock released: nothing to fence.
		err = fence.clean()
	}
	return err
}

// ownState makes this process the state directory's daemon: it takes
// the lock, or with cfg.TakeOver has the running daemon hand it over
// with its devices (tk), whose images m opens ahead while the old daemon
// still serves them. A nil lock and nil error: another daemon serves,
// and keeps serving.
func ownState(cfg Config, m *attach.Manager, log *slog.Logger) (lock *os.File, tk *taken, err error) {
	if lock, err = lockState(cfg.StateDir); err != nil || lock != nil || !cfg.TakeOver {
		return lock, nil, err
	}
	var prep *attach.Prepared
	if recs, err := list(cfg.StateDir); err != nil {
		log.Info("no device list from the running daemon; opening at the handover", "err", err)
	} else {
		t0 := time.Now()
		prep = m.Prepare(recs)
		log.Info("images opened ahead of the handover", "devices", len(recs), "took", time.Since(t0).Round(time.Millisecond))
	}
	if tk, err = take(cfg.StateDir, log); err != nil {
		t0 := time.Now()
		prep.Close()
		closed := time.Since(t0).Round(time.Millisecond)
		// The running daemon may be dying (its pod stopped before we
		// asked): then its lock is free in a moment, and this daemon
		// starts as after any restart.
		for range 20 {
			time.Sleep(100 * time.Millisecond)
			if lock, lerr := lockState(cfg.StateDir); lerr != nil || lock != nil {
				log.Warn("no handover: the previous daemon is gone; reattaching", "err", err,
					"closed_opened_ahead", closed, "waited", time.Since(t0).Round(time.Millisecond))
				return lock, nil, lerr
			}
		}
		log.Warn("not taking over: the running daemon serves on", "err", err)
		return nil, nil, nil
	}
	tk.prepared = prep
	lock, tk.lock = tk.lock, nil
	writePID(lock)
	return lock, tk, nil
}

// lockState takes the state directory's daemon lock, writing our pid in
// it. A nil file and nil error: another daemon holds it.
func lockState(dir string) (*os.File, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	lock, err := os.OpenFile(filepath.Join(dir, "daemon.lock"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, err
	}
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		lock.Close()
		return nil, nil
	}
	writePID(lock)
	return lock, nil
}

// writePID records our pid in the lock file (for people; the lock is
// the flock).
func writePID(lock *os.File) {
	lock.Truncate(0)
	lock.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
}

// startCPUProfile profiles the whole run into path, if set; the returned
// func stops it.
func startCPUProfile(path string) func() {
	if path == "" {
		return nil
	}
	f, err := os.Create(path)
	if err != nil {
		return nil
	}
	pprof.StartCPUProfile(f)
	return func() { pprof.StopCPUProfile(); f.Close() }
}

// openKernel opens the kernel's NBD interface: netlink, unless the
// config asks for ioctl.
func openKernel(cfg Config) (kernel.Controller, error) {
	ctl, err := kernel.Open(cfg.Module)
	if err != nil {
		return nil, err
	}
	if cfg.KernelInterface == "ioctl" && ctl.Name() != "ioctl" {
		ctl.Close()
		ctl = kernel.NewIoctl()
	}
	return ctl, nil
}

// newManager opens the state directory's records and the manager of
// its devices.
func newManager(cfg Config, ctl kernel.Controller, clusters *rbdio.Clusters, log *slog.Logger) (*attach.Manager, error) {
	store, err := attach.OpenStore(cfg.StateDir)
	if err != nil {
		return nil, err
	}
	return attach.NewManager(attach.Config{Kernel: ctl, Clusters: clusters, Store: store, Log: log,
		MemoryBudget: cfg.MemoryBudget}), nil
}

// takeBack serves every device the state directory records: those a
// previous daemon handed over (tk), then the rest by reattach. Only
// then does it open the control and handover sockets (or take the
// handed ones): a client that reaches them finds the devices served.
func takeBack(cfg Config, m *attach.Manager, tk *taken, log *slog.Logger) (net.Listener, net.Listener, error) {
	if tk != nil {
		t0 := time.Now()
		err := m.Adopt(tk.handed, tk.prepared)
		tk.handed, tk.prepared = nil, nil // the manager's, or closed by Adopt
		tk.done(len(m.List()), err)
		attrs := []any{"devices", len(m.List()), "took", time.Since(t0).Round(time.Millisecond), "err", err}
		if !tk.paused.IsZero() {
			// Every socket is read again once Adopt returns: an upper
			// bound, per device, of the wait the handover added.
			// Its parts: until the last device had arrived, and until
			// Adopt began (the sessions record in between).
			ms := func(d time.Duration) time.Duration { return d.Round(time.Millisecond) }
			attrs = append(attrs, "reads_paused_for", ms(time.Since(tk.paused)),
				"received_after", ms(tk.received.Sub(tk.paused)), "adopting_after", ms(t0.Sub(tk.paused)))
		}
		log.Info("took over from the previous daemon", attrs...)
	}
	if err := m.Restore(); err != nil {
		log.Error("some devices were not reattached", "err", err)
	}
	if tk != nil {
		l, hl := tk.control, tk.hand
		tk.control, tk.hand = nil, nil
		return l, hl, nil
	}
	l, err := unixsock.Listen(control.SocketPath(cfg.StateDir))
	if err != nil {
		m.Close()
		return nil, nil, err
	}
	hl, err := unixsock.ListenSeqpacket(HandoverSocket(cfg.StateDir))
	if err != nil {
		l.Close()
		m.Close()
		return nil, nil, err
	}
	return l, hl, nil
}

// startBackground starts what runs beside the control socket: the
// LINK_DEAD watch (netlink only), the scheduler's idle threads, and
// giving memory back a few seconds after devices go away.
func startBackground(ctx context.Context, cfg Config, ctl kernel.Controller, m *attach.Manager, log *slog.Logger) *procs {
	if ctl.Name() == "netlink" {
		// Each replacement on its own goroutine: it may wait up to
		// seconds for the kernel to read the dead socket empty
		// (attach/settle.go), and events of other devices, which many
		// timeouts at once bring, must not queue up behind it (nor
		// overflow the multicast socket). The device's lock orders
		// those of one device.
		replace := func(index int) { go m.ReplaceDead(index) }
		go func() {
			if err := kernel.WatchLinkDead(ctx, replace); err != nil {
				log.Warn("not watching LINK_DEAD", "err", err)
			}
		}()
	}
	devices := func() int { return len(m.List()) }
	sched := newProcs(cfg.IdleProcs, devices)
	sched.start()
	go giveBack(ctx, 5*time.Second, devices, func() {
		t0 := time.Now()
		releaseMemory(sched, rbdio.ReleaseFreeMemory)
		log.Info("memory given back", append(append([]any{"took", time.Since(t0).Round(time.Millisecond)}, goMemory()...), rbdio.CMemory()...)...)
	})
	return sched
}

// deviceMetrics reads the manager's devices for a scrape.
func deviceMetrics(m *attach.Manager) metrics.Source {
	return func() []metrics.Device {
		var out []metrics.Device
		for _, d := range m.Stats() {
			md := metrics.ForSpec(d.Record.Device(), d.Record.Spec, d.Record.Cookie, d.Stats)
			md.PVC, md.PVCNamespace = d.Record.PVC, d.Record.PVCNamespace
			md.Replaced, md.Reattached, md.Resized = d.Replaced, d.Reattached, d.Resized
			out = append(out, md)
		}
		return out
	}
}

// connMetrics reads the cluster connections for a scrape.
func connMetrics(c *rbdio.Clusters) metrics.ClusterSource {
	return func() []metrics.Connection {
		var out []metrics.Connection
		for _, cn := range c.Connections() {
			out = append(out, metrics.Connection{Cluster: cn.Cluster, User: cn.User, Images: cn.Images})
		}
		return out
	}
}

// newInstance is a random word naming this daemon to its clients.
func newInstance() string {
	b := make([]byte, 8)
	rand.Read(b)
	return hex.EncodeToString(b)
}

type nopCloser struct{ io.Writer }

func (nopCloser) Close() error { return nil }
