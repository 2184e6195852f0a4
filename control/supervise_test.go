package control

import (
	"context"
	"net"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"testing"
	"time"
)

// fakeDaemonEnv makes this test binary, started as the daemon, stand in
// for it: it serves pings on the state directory's control socket,
// answering with its pid, says ready on fd 3, exits 0 on SIGTERM (as
// the daemon does) and exits once the test that started it is gone.
const fakeDaemonEnv = "RBD_NBD_GO_TEST_FAKE_DAEMON"

func TestMain(m *testing.M) {
	if dir := os.Getenv(fakeDaemonEnv); dir != "" {
		runFakeDaemon(dir)
		return
	}
	os.Exit(m.Run())
}

func runFakeDaemon(dir string) {
	parent := os.Getppid()
	term := make(chan os.Signal, 1)
	signal.Notify(term, syscall.SIGTERM)
	go func() {
		for {
			select {
			case <-term:
				os.Exit(0)
			case <-time.After(100 * time.Millisecond):
				if os.Getppid() != parent {
					os.Exit(0)
				}
			}
		}
	}()
	os.Remove(SocketPath(dir)) // a killed one's
	l, err := net.Listen("unix", SocketPath(dir))
	if err != nil {
		os.NewFile(3, "ready").WriteString(err.Error() + "\n")
		os.Exit(1)
	}
	os.NewFile(3, "ready").WriteString(ReadyOK + "\n")
	inst := strconv.Itoa(os.Getpid())
	servePings(l, os.Getpid(), func() string { return inst })
	os.Exit(1)
}

// TestSuperviseRestartsItsChildAtOnce: the plugin's own daemon, killed,
// is started again as soon as it dies, not at the supervisor's next
// check; one that exits cleanly (a SIGTERM, or devices handed to a newer
// daemon) is left to the next check.
func TestSuperviseRestartsItsChildAtOnce(t *testing.T) {
	dir := t.TempDir()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv(fakeDaemonEnv, dir)
	p := (&Client{StateDir: dir, Start: StartOptions{Exe: exe}}).NewPluginDaemon()
	ctx, cancel := context.WithCancel(t.Context())
	restarted := make(chan int, 8)
	done := make(chan struct{})
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
		}
		syscall.Kill(int(p.pid.Load()), syscall.SIGKILL) // the fakes also end with this test
	})
	if err := p.Start(ctx); err != nil {
		close(done)
		t.Fatal(err)
	}
	first := int(p.pid.Load())
	if first == 0 {
		close(done)
		t.Fatal("the started daemon was not remembered")
	}
	// A child that had served less than an interval keeps to the
	// interval (no spawn loop of a daemon dying at once); past it, its
	// death is acted on at once. Ticks at 4 s and 8 s: killed at 4.3 s,
	// it must be back well before 8 s.
	const interval = 4 * time.Second
	go func() {
		defer close(done)
		p.Supervise(ctx, interval, func(err error) {
			if err != nil {
				t.Errorf("restart: %v", err)
			}
			restarted <- int(p.pid.Load())
		})
	}()
	time.Sleep(interval + 300*time.Millisecond)
	t0 := time.Now()
	if err := syscall.Kill(first, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	var second int
	select {
	case second = <-restarted:
	case <-time.After(interval):
		t.Fatal("no restart")
	}
	if d := time.Since(t0); d > 2*time.Second {
		t.Fatalf("restarted %s after the kill: at a tick, not at the death", d)
	}
	if second == first || second == 0 {
		t.Fatalf("the new daemon is pid %d (the killed one was %d)", second, first)
	}
	// The new one exits cleanly 4.3 s into its life: the next tick, not
	// its exit, starts another (the tick comes 3.7 s later).
	time.Sleep(interval + 300*time.Millisecond)
	if err := syscall.Kill(second, syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case pid := <-restarted:
		t.Fatalf("a daemon that exited cleanly was replaced at once (by pid %d)", pid)
	case <-time.After(2 * time.Second):
	}
}
