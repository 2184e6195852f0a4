package unixsock

import (
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestListenUnixPermissionsAndStale(t *testing.T) {
	p := filepath.Join(t.TempDir(), "nbd.sock")
	l, err := Listen(p)
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(p)
	if err != nil || fi.Mode().Perm() != 0o600 || fi.Mode()&os.ModeSocket == 0 {
		t.Fatalf("socket mode %v %v", fi.Mode(), err)
	}
	go func() {
		if c, err := l.Accept(); err == nil {
			c.Close()
		}
	}()
	if _, err := Listen(p); err == nil || !strings.Contains(err.Error(), "another server") {
		t.Fatalf("second listener on a live socket: %v", err)
	}
	l.Close()
	if _, err := os.Stat(p); !os.IsNotExist(err) {
		t.Fatal("Close left the socket file behind")
	}
	// A stale socket (bound, never closed properly) is replaced.
	stale, _ := net.Listen("unix", p)
	stale.(*net.UnixListener).SetUnlinkOnClose(false)
	stale.Close()
	l2, err := Listen(p)
	if err != nil {
		t.Fatalf("stale socket not replaced: %v", err)
	}
	l2.Close()
	os.WriteFile(p, []byte("x"), 0o600)
	if _, err := Listen(p); err == nil {
		t.Fatal("replaced a regular file")
	}
}

// TestHandoff: a handed-off listener keeps its path and its queue: a
// client that dials while no one accepts is accepted by the receiver.
func TestHandoff(t *testing.T) {
	p := filepath.Join(t.TempDir(), "ctl.sock")
	l, err := Listen(p)
	if err != nil {
		t.Fatal(err)
	}
	f, err := Handoff(l)
	if err != nil {
		t.Fatal(err)
	}
	l.Close()
	if _, err := os.Lstat(p); err != nil {
		t.Fatalf("the handed-off socket's path went away: %v", err)
	}
	c, err := net.Dial("unix", p) // queued in the backlog meanwhile
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	l2, err := FromFile(f, p)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	a, err := l2.Accept()
	if err != nil {
		t.Fatal(err)
	}
	a.Close()
	l2.Close()
	if _, err := os.Lstat(p); !os.IsNotExist(err) {
		t.Fatalf("the receiver's Close left the path: %v", err)
	}
	if _, err := Handoff(struct{ net.Listener }{l2}); err == nil {
		t.Fatal("handoff of a foreign listener")
	}
}

// TestReplace: a new server takes the path from a live one (an upgrade
// with the pods overlapping); the old one's Close leaves it alone.
func TestReplace(t *testing.T) {
	p := filepath.Join(t.TempDir(), "csi.sock")
	old, err := Listen(p)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Listen(p); err == nil {
		t.Fatal("Listen took a live server's path")
	}
	l, err := Replace(p)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		if c, err := l.Accept(); err == nil {
			c.Write([]byte("new"))
			c.Close()
		}
	}()
	c, err := net.Dial("unix", p)
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 3)
	if n, _ := c.Read(b); string(b[:n]) != "new" {
		t.Fatalf("dialled %q, want the new server", b[:n])
	}
	c.Close()
	old.Close()
	if _, err := os.Lstat(p); err != nil {
		t.Fatalf("the old server's Close removed the new one's socket: %v", err)
	}
	l.Close()
	if _, err := os.Lstat(p); !os.IsNotExist(err) {
		t.Fatalf("the new server's Close left its socket: %v", err)
	}
}
