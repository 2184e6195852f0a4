package rbdio

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"io"
	"net"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
)

// TestLentReads: large READs on an NBD connection are lent from librbd's
// own buffers (and, on a kernel-style socket, spliced) instead of copied.
// What arrives must be the image's bytes — written data, holes and
// partly written objects alike — and every loan must come back.
func TestLentReads(t *testing.T) {
	spec := newImage(t, "32M")
	im := open(t, NewClusters(), spec, OpenOptions{})
	for _, w := range []struct{ off, n int }{{0, 8 << 20}, {12<<20 + 4096, 1 << 20}, {20 << 20, 64 << 10}} {
		b := make([]byte, w.n)
		rand.Read(b)
		if err := do(t, im, nbd.OpWrite, 0, uint64(w.off), b, w.n); err != nil {
			t.Fatal(err)
		}
	}
	want := export(t, spec)

	s := nbd.NewServer(nbd.Config{})
	if err := s.AddExport(nbd.Export{Backend: im}); err != nil {
		t.Fatal(err)
	}
	a, c := socketpair(t)
	go s.ServeNegotiated(a, "")
	c.SetDeadline(time.Now().Add(60 * time.Second))

	type req struct{ off, n int }
	var reqs []req
	for off := 0; off < 32<<20; off += 1 << 20 {
		reqs = append(reqs, req{off, 1 << 20})
	}
	reqs = append(reqs, req{12 << 20, 192 << 10}, req{20<<20 - 32<<10, 128 << 10}, req{3 << 20, 4096})
	go func() {
		h := make([]byte, 28)
		for i, r := range reqs {
			binary.BigEndian.PutUint32(h[0:], 0x25609513)
			binary.BigEndian.PutUint32(h[4:], 0) // flags, READ
			binary.BigEndian.PutUint64(h[8:], uint64(i))
			binary.BigEndian.PutUint64(h[16:], uint64(r.off))
			binary.BigEndian.PutUint32(h[24:], uint32(r.n))
			if _, err := c.Write(h); err != nil {
				return
			}
		}
	}()
	br := bufio.NewReader(c)
	h := make([]byte, 16)
	for range reqs {
		if _, err := io.ReadFull(br, h); err != nil {
			t.Fatal(err)
		}
		if m, e := binary.BigEndian.Uint32(h), binary.BigEndian.Uint32(h[4:]); m != 0x67446698 || e != 0 {
			t.Fatalf("reply magic %#x error %d", m, e)
		}
		r := reqs[binary.BigEndian.Uint64(h[8:])]
		got := make([]byte, r.n)
		if _, err := io.ReadFull(br, got); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want[r.off:r.off+r.n]) {
			t.Fatalf("read %d bytes at %d: differs from rbd export", r.n, r.off)
		}
	}
	if im.loans.lent.Load() == 0 {
		t.Fatal("no read was lent: the test did not test lending")
	}
	c.Close()
	if err := s.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if out := im.loans.out.Load(); out != 0 {
		t.Fatalf("%d loans never released", out)
	}
	t.Logf("%d of %d reads lent", im.loans.lent.Load(), len(reqs))
}

func socketpair(t *testing.T) (net.Conn, net.Conn) {
	t.Helper()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	var cs [2]net.Conn
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "socketpair")
		if cs[i], err = net.FileConn(f); err != nil {
			t.Fatal(err)
		}
		f.Close()
	}
	t.Cleanup(func() { cs[0].Close(); cs[1].Close() })
	return cs[0], cs[1]
}
