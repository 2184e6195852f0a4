package control

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// fakeDaemon answers every request with its current instance word.
func fakeDaemon(t *testing.T, dir string, instance *atomic.Value) {
	l, err := net.Listen("unix", SocketPath(dir))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go servePings(l, 0, func() string { return instance.Load().(string) })
}

// servePings answers every request on l as a daemon with this pid and
// instance word would, until l fails.
func servePings(l net.Listener, pid int, instance func() string) error {
	for {
		c, err := l.Accept()
		if err != nil {
			return err
		}
		var req Request
		json.NewDecoder(c).Decode(&req)
		json.NewEncoder(c).Encode(Response{PID: pid, Instance: instance()})
		c.Close()
	}
}

// TestReleaseWaitsForTakeOver: a stopping plugin keeps its daemon until
// another instance answers on the socket, and no longer than told.
func TestReleaseWaitsForTakeOver(t *testing.T) {
	dir := t.TempDir()
	var inst atomic.Value
	inst.Store("old")
	fakeDaemon(t, dir, &inst)
	p := &PluginDaemon{c: &Client{StateDir: dir}}
	p.mine.Store("")
	p.remember(t.Context())
	if p.mine.Load() != "old" {
		t.Fatalf("remembered %v", p.mine.Load())
	}
	t0 := time.Now()
	if p.Release(300 * time.Millisecond) {
		t.Fatal("released as taken over while the same daemon answers")
	}
	if d := time.Since(t0); d < 300*time.Millisecond {
		t.Fatalf("gave up after %s, before the wait", d)
	}
	go func() { time.Sleep(300 * time.Millisecond); inst.Store("new") }()
	t0 = time.Now()
	if !p.Release(10 * time.Second) {
		t.Fatal("the takeover was not seen")
	}
	if d := time.Since(t0); d > 5*time.Second {
		t.Fatalf("took %s to see the takeover", d)
	}
	// Nothing answering counts as gone.
	q := &PluginDaemon{c: &Client{StateDir: filepath.Join(dir, "none")}}
	q.mine.Store("x")
	if !q.Release(10 * time.Second) {
		t.Fatal("a daemon gone was waited for")
	}
}

// TestReleaseWaitsThroughFailedCalls: a daemon that takes calls but
// does not answer them is not gone; the wait goes on to its end.
func TestReleaseWaitsThroughFailedCalls(t *testing.T) {
	dir := t.TempDir()
	l, err := net.Listen("unix", SocketPath(dir))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	p := &PluginDaemon{c: &Client{StateDir: dir}}
	p.mine.Store("old")
	t0 := time.Now()
	if p.Release(500 * time.Millisecond) {
		t.Fatal("a daemon that failed a call counted as taken over")
	}
	if d := time.Since(t0); d < 500*time.Millisecond {
		t.Fatalf("gave up after %s, before the wait", d)
	}
}

// TestLockFree: a daemon that died leaves its lock free; one that runs,
// or one about to make the file, does not.
func TestLockFree(t *testing.T) {
	dir := t.TempDir()
	if lockFree(dir) {
		t.Fatal("no lock file yet counts as free (a daemon may be starting)")
	}
	f, err := os.Create(filepath.Join(dir, "daemon.lock"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if !lockFree(dir) {
		t.Fatal("an unheld lock counts as held")
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	if lockFree(dir) {
		t.Fatal("a held lock counts as free")
	}
}

// TestSuperviseBacksOff: a daemon that will not start (no NBD in the
// kernel) is tried again after doubling waits, not every interval, and
// each try is reported with its error.
func TestSuperviseBacksOff(t *testing.T) {
	dir := t.TempDir()
	runs := filepath.Join(dir, "runs")
	exe := filepath.Join(dir, "daemon.sh")
	script := "#!/bin/sh\necho run >> " + runs + "\necho 'this kernel has no NBD driver' >&3\n"
	if err := os.WriteFile(exe, []byte(script), 0o700); err != nil {
		t.Fatal(err)
	}
	p := &PluginDaemon{c: &Client{StateDir: filepath.Join(dir, "state"), Start: StartOptions{Exe: exe}}}
	p.mine.Store("")
	var reported atomic.Int32
	var bad atomic.Value
	bad.Store("")
	ctx, cancel := context.WithTimeout(t.Context(), 1200*time.Millisecond)
	defer cancel()
	// Interval 50 ms: tries at about 50, 150, 350 and 750 ms, where a
	// fixed interval would make 24. The end falls between tries: a try
	// cut short by it would report the cut, not the daemon's reason.
	p.Supervise(ctx, 50*time.Millisecond, func(err error) {
		reported.Add(1)
		if err == nil || err.Error() != "this kernel has no NBD driver" {
			bad.Store(fmt.Sprint(err))
		}
	})
	b, _ := os.ReadFile(runs)
	n := strings.Count(string(b), "run")
	if n < 3 || n > 6 {
		t.Fatalf("the daemon was started %d times in 1.2 s at a 50 ms interval; want 3-6 with doubling waits", n)
	}
	if int(reported.Load()) != n {
		t.Errorf("%d starts, %d reported", n, reported.Load())
	}
	if s := bad.Load().(string); s != "" {
		t.Errorf("reported %q, want the daemon's own reason", s)
	}
}
