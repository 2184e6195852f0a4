package control

import (
	"encoding/json"
	"net"
	"os"
	"path/filepath"
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
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			var req Request
			json.NewDecoder(c).Decode(&req)
			json.NewEncoder(c).Encode(Response{Instance: instance.Load().(string)})
			c.Close()
		}
	}()
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
