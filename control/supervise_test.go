package control

import (
	"context"
	"encoding/json"
	"net"
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"
)

// fakeDaemonEnv makes this test binary, started as the daemon, stand in
// for it: it serves pings on the state directory's control socket,
// answering with its pid, and says ready on fd 3.
const fakeDaemonEnv = "RBD_NBD_GO_TEST_FAKE_DAEMON"

func TestMain(m *testing.M) {
	if dir := os.Getenv(fakeDaemonEnv); dir != "" {
		runFakeDaemon(dir)
		return
	}
	os.Exit(m.Run())
}

// runFakeDaemon serves until killed.
func runFakeDaemon(dir string) {
	os.Remove(SocketPath(dir)) // a killed one's
	l, err := net.Listen("unix", SocketPath(dir))
	if err != nil {
		os.NewFile(3, "ready").WriteString(err.Error() + "\n")
		os.Exit(1)
	}
	os.NewFile(3, "ready").WriteString(ReadyOK + "\n")
	inst := strconv.Itoa(os.Getpid())
	for {
		c, err := l.Accept()
		if err != nil {
			os.Exit(1)
		}
		var req Request
		json.NewDecoder(c).Decode(&req)
		json.NewEncoder(c).Encode(Response{PID: os.Getpid(), Instance: inst})
		c.Close()
	}
}

// TestSuperviseRestartsItsChildAtOnce: the plugin's own daemon, killed,
// is started again as soon as it exits, not at the supervisor's next
// check.
func TestSuperviseRestartsItsChildAtOnce(t *testing.T) {
	dir := t.TempDir()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv(fakeDaemonEnv, dir)
	p := (&Client{StateDir: dir, Start: StartOptions{Exe: exe}}).NewPluginDaemon()
	ctx, cancel := context.WithCancel(t.Context())
	if err := p.Start(ctx); err != nil {
		t.Fatal(err)
	}
	first := int(p.pid.Load())
	if first == 0 {
		t.Fatal("the started daemon was not remembered")
	}
	// A child that had served less than an interval keeps to the
	// interval (no spawn loop of a daemon dying at once); past it, its
	// exit is acted on at once. Ticks at 4 s and 8 s: killed at 4.3 s,
	// it must be back well before 8 s.
	const interval = 4 * time.Second
	restarted := make(chan struct{}, 8)
	done := make(chan struct{})
	go func() {
		defer close(done)
		p.Supervise(ctx, interval, func(err error) {
			if err != nil {
				t.Errorf("restart: %v", err)
			}
			restarted <- struct{}{}
		})
	}()
	defer func() {
		cancel()
		<-done
		if pid := int(p.pid.Load()); pid > 0 {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	}()
	time.Sleep(interval + 300*time.Millisecond)
	t0 := time.Now()
	if err := syscall.Kill(first, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	select {
	case <-restarted:
	case <-time.After(interval):
		t.Fatal("no restart")
	}
	if d := time.Since(t0); d > 2*time.Second {
		t.Fatalf("restarted %s after the kill: at a tick, not at the exit", d)
	}
	if pid := int(p.pid.Load()); pid == first || pid == 0 {
		t.Fatalf("the new daemon is pid %d (the killed one was %d)", pid, first)
	}
}
