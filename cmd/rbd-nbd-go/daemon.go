package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/rbd-nbd-go/rbd-nbd-go/attach"
	"github.com/rbd-nbd-go/rbd-nbd-go/kernel"
	"github.com/rbd-nbd-go/rbd-nbd-go/rbdio"
)

// The node daemon: one long-lived process serving every /dev/nbdX of the
// node. The CLI starts it on first use; a restarted one takes every
// device back from the state directory before it answers.

func newDaemon(g *globalOpts) *cobra.Command {
	var mod kernel.ModuleOptions
	readyFD := -1
	cmd := &cobra.Command{
		Use:    "daemon",
		Short:  "Serve this node's NBD devices (started by map/attach on first use)",
		Args:   cobra.NoArgs,
		Hidden: true,
		RunE: func(cmd *cobra.Command, args []string) error {
			var ready io.WriteCloser = nopWriteCloser{}
			if readyFD >= 0 {
				ready = os.NewFile(uintptr(readyFD), "ready")
			}
			log := logger(g.logLevel)
			err := runDaemon(log, g.stateDir, mod, ready)
			if err == nil {
				ready.Close()
				return nil
			}
			// Logged before map hears of it, so its "see daemon.log"
			// is never ahead of the log.
			log.Error("daemon stopped", "err", err)
			fmt.Fprintf(ready, "%s\n", err)
			ready.Close()
			return &exitError{code: 1}
		},
	}
	f := cmd.Flags()
	f.IntVar(&mod.NbdsMax, "nbds_max", 0, "nbd module parameter, if the daemon loads the module")
	f.IntVar(&mod.MaxPart, "max_part", 0, "nbd module parameter, if the daemon loads the module")
	f.IntVar(&readyFD, "ready-fd", -1, "write \"ok\" (or the error) here once serving")
	return cmd
}

type nopWriteCloser struct{}

func (nopWriteCloser) Write(p []byte) (int, error) { return len(p), nil }
func (nopWriteCloser) Close() error                { return nil }

// errAlreadyRunning: another daemon holds the state directory.
var errAlreadyRunning = errors.New("running")

func runDaemon(log *slog.Logger, stateDir string, mod kernel.ModuleOptions, ready io.WriteCloser) error {
	if err := os.MkdirAll(stateDir, 0o700); err != nil {
		return err
	}
	lock, err := os.OpenFile(filepath.Join(stateDir, "daemon.lock"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return err
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		fmt.Fprintln(ready, errAlreadyRunning)
		ready.Close()
		return nil
	}
	lock.Truncate(0)
	lock.WriteString(strconv.Itoa(os.Getpid()) + "\n")
	if p := os.Getenv("RBD_NBD_GO_CPU_PROFILE"); p != "" {
		// Development: profile the daemon until it stops (SIGTERM).
		if f, err := os.Create(p); err == nil {
			pprof.StartCPUProfile(f)
			defer func() { pprof.StopCPUProfile(); f.Close() }()
		}
	}
	protectFromReclaim(log)
	ctl, err := kernel.Open(mod)
	if err != nil {
		return err
	}
	if os.Getenv("RBD_NBD_GO_KERNEL_INTERFACE") == "ioctl" && ctl.Name() != "ioctl" {
		// Exercise the fallback on a kernel that has netlink (tests).
		ctl.Close()
		ctl = kernel.NewIoctl()
	}
	defer ctl.Close()
	store, err := attach.OpenStore(stateDir)
	if err != nil {
		return err
	}
	m := attach.NewManager(attach.Config{Kernel: ctl, Clusters: rbdio.NewClusters(), Store: store, Log: log})
	if err := m.Restore(); err != nil {
		log.Error("some devices were not reattached", "err", err)
	}
	l, err := attach.ListenControl(stateDir)
	if err != nil {
		m.Close()
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	signal.Ignore(syscall.SIGHUP, syscall.SIGPIPE)
	if ctl.Name() == "netlink" {
		go func() {
			if err := kernel.WatchLinkDead(ctx, m.ReplaceDead); err != nil {
				log.Warn("not watching LINK_DEAD", "err", err)
			}
		}()
	}
	log.Info("serving NBD devices", "pid", os.Getpid(), "kernel", ctl.Name(), "state", stateDir,
		"devices", len(m.List()))
	fmt.Fprintln(ready, "ok")
	ready.Close()
	serr := attach.ServeControl(ctx, l, m, log)
	// Devices stay in the kernel: the next daemon reattaches them.
	log.Info("stopping; devices stay mapped for the next daemon")
	return errors.Join(serr, m.Close())
}

// protectFromReclaim keeps the daemon from deadlocking under memory
// pressure: its own allocations must not wait on writeback to the devices
// it serves (PR_SET_IO_FLUSHER), and its pages must not be swapped out
// (mlockall; MCL_ONFAULT so address space reserved by Go and librados
// costs nothing until touched).
//
// PR_SET_IO_FLUSHER marks only the calling thread, and Go's threads (and
// librbd's) come from many places; but the mark is inherited by new
// threads and kept across exec. So the CLI sets it on the thread that
// forks the daemon (startFlusher), and every daemon thread is born with
// it. Here we only check, and mark this thread for daemons started by
// other means.
func protectFromReclaim(log *slog.Logger) {
	if on, _ := unix.PrctlRetInt(prGetIOFlusher, 0, 0, 0, 0); on != 1 {
		log.Warn("started without PR_SET_IO_FLUSHER: only some threads get it")
		if err := unix.Prctl(prSetIOFlusher, 1, 0, 0, 0); err != nil {
			log.Warn("PR_SET_IO_FLUSHER failed", "err", err)
		}
	}
	if err := unix.Mlockall(unix.MCL_CURRENT | unix.MCL_FUTURE | unix.MCL_ONFAULT); err != nil {
		log.Warn("mlockall failed", "err", err)
	}
}

const (
	prSetIOFlusher = 57
	prGetIOFlusher = 58
)

// startFlusher starts cmd from a thread marked PR_SET_IO_FLUSHER, so the
// process inherits the mark on every thread it will have. The thread is
// thrown away afterwards (never unlocked).
func startFlusher(cmd *exec.Cmd) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		unix.Prctl(prSetIOFlusher, 1, 0, 0, 0) // the daemon reports if this failed
		errc <- cmd.Start()
	}()
	return <-errc
}

// errNoDaemon: nothing serves this node and nothing is recorded.
var errNoDaemon = errors.New("no rbd-nbd-go daemon is running")

// callDaemon sends req to the node daemon, starting it when it is not
// running and either start is set or devices are recorded (a restarted
// node's devices need their server back).
func callDaemon(g *globalOpts, mod kernel.ModuleOptions, req attach.Request, start bool) (attach.Response, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	resp, err := attach.Call(ctx, g.stateDir, req)
	if err == nil || !daemonAbsent(err) {
		return resp, err
	}
	if !start && !hasRecords(g.stateDir) {
		return resp, errNoDaemon
	}
	if err := spawnDaemon(g, mod); err != nil {
		return resp, err
	}
	return attach.Call(ctx, g.stateDir, req)
}

func daemonAbsent(err error) bool {
	return errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED)
}

func hasRecords(stateDir string) bool {
	m, _ := filepath.Glob(filepath.Join(stateDir, "devices", "nbd*.json"))
	return len(m) > 0
}

// spawnDaemon starts the daemon in its own session, logging to
// STATE_DIR/daemon.log, and waits until it serves (or says why not).
func spawnDaemon(g *globalOpts, mod kernel.ModuleOptions) error {
	if err := os.MkdirAll(g.stateDir, 0o700); err != nil {
		return err
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	logf, err := os.OpenFile(filepath.Join(g.stateDir, "daemon.log"), os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		return err
	}
	defer logf.Close()
	pr, pw, err := os.Pipe()
	if err != nil {
		return err
	}
	defer pr.Close()
	cmd := exec.Command(exe, "daemon", "--state-dir", g.stateDir, "--log-level", g.logLevel,
		"--nbds_max", strconv.Itoa(mod.NbdsMax), "--max_part", strconv.Itoa(mod.MaxPart), "--ready-fd", "3")
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.ExtraFiles = []*os.File{pw}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	cmd.Dir = "/"
	err = startFlusher(cmd)
	pw.Close()
	if err != nil {
		return fmt.Errorf("start daemon: %w", err)
	}
	waited := make(chan struct{})
	go func() { cmd.Wait(); close(waited) }()
	pr.SetReadDeadline(time.Now().Add(3 * time.Minute))
	line, _ := bufio.NewReader(pr).ReadString('\n')
	line = strings.TrimSpace(line)
	switch line {
	case "ok":
		return nil
	case errAlreadyRunning.Error():
		// Lost a start race: the winner may still be restoring.
		for range 600 {
			if _, err := os.Stat(attach.SocketPath(g.stateDir)); err == nil {
				return nil
			}
			time.Sleep(100 * time.Millisecond)
		}
		return errors.New("another rbd-nbd-go daemon holds the state directory but does not answer")
	case "":
		<-waited
		return fmt.Errorf("the rbd-nbd-go daemon exited at start (see %s)", filepath.Join(g.stateDir, "daemon.log"))
	}
	return errors.New(line)
}
