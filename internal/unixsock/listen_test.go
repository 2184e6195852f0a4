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
