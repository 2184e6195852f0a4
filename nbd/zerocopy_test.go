package nbd

import (
	"bufio"
	"bytes"
	"context"
	"testing"
	"time"
)

// TestZeroCopyPayloadsNotReusedEarly: large READ replies go out by page
// reference, so their buffers must not be reused before the client has
// read them. The client asks for many regions at once and reads nothing
// for a while, so the server fills the socket and parks payloads while it
// keeps reading further regions into pooled buffers; every reply must
// still carry its own region. Reusing a parked buffer too early makes an
// earlier reply show a later region's bytes.
func TestZeroCopyPayloadsNotReusedEarly(t *testing.T) {
	const region, regions = 1 << 20, 24
	for _, tc := range []struct {
		name   string
		mode   ZeroCopy
		kernel bool // ServeNegotiated, as the kernel's sockets are served
	}{
		{"unix", ZeroCopyUnix, false},
		{"kernel-default", ZeroCopyKernel, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dev := newFlat(region * regions)
			for i := range regions {
				copy(dev.b[i*region:], pattern(region, byte(i)))
			}
			s := NewServer(Config{ZeroCopy: tc.mode, SendBuffer: 4 << 20, MaxInflight: 4})
			s.AddExport(Export{Backend: NewPool(dev, 4)})
			t.Cleanup(func() { s.Shutdown(context.Background()) })
			var c *tclient
			if tc.kernel {
				a, b := socketpair(t)
				go s.ServeNegotiated(a, "")
				c = &tclient{t: t, c: b, br: bufio.NewReader(b)}
				t.Cleanup(func() { b.Close() })
			} else {
				c = connect(t, s)
				c.open("", false)
			}
			c.c.SetDeadline(time.Now().Add(60 * time.Second))
			c.slowReads(96, regions, region)
			if s.spliced.Load() == 0 {
				t.Fatal("no payload was spliced: the test did not test zero-copy")
			}
		})
	}
}

// TestZeroCopyOnlyWhereSafe: TCP never splices (loopback receivers keep
// clones of acknowledged buffers), and by default neither do handshake
// clients on unix sockets, which might splice what they read.
func TestZeroCopyOnlyWhereSafe(t *testing.T) {
	dev := newFlat(4 << 20)
	for _, tc := range []struct {
		name string
		mode ZeroCopy
		tcp  bool
	}{
		{"tcp", ZeroCopyUnix, true},
		{"unix-default", ZeroCopyKernel, false},
		{"unix-off", ZeroCopyOff, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := NewServer(Config{ZeroCopy: tc.mode})
			s.AddExport(Export{Backend: Inline(dev)})
			c := dialTest(t, s, tc.tcp)
			c.c.SetDeadline(time.Now().Add(30 * time.Second))
			c.open("", false)
			c.send(cmdRead, 0, 1, 0, 1<<20, nil)
			if r := c.recv(1 << 20); r.errno != 0 {
				t.Fatalf("read: errno %d", r.errno)
			}
			if n := s.spliced.Load(); n != 0 {
				t.Fatalf("%d bytes spliced", n)
			}
		})
	}
}

// slowReads asks for n regions (region k holds pattern(region, k)) all at
// once and reads the replies slowly: payloads sit in the socket while the
// server reads on into buffers it recycles. Every reply must still carry
// its own region.
func (c *tclient) slowReads(n, regions, region int) {
	c.t.Helper()
	go func() {
		for i := range n {
			k := (i * 7) % regions
			c.c.Write(reqBytes(cmdRead, 0, uint64(k), uint64(k*region), uint32(region), nil))
		}
	}()
	for i := range n {
		if i%8 == 0 {
			time.Sleep(5 * time.Millisecond) // let the socket fill
		}
		r := c.recv(region)
		if r.errno != 0 {
			c.t.Fatalf("reply %d: errno %d", i, r.errno)
		}
		if want := pattern(region, byte(r.cookie)); !bytes.Equal(r.data, want) {
			j := 0
			for r.data[j] == want[j] {
				j++
			}
			c.t.Fatalf("reply %d: region %d differs from byte %d on (reused or released too early?)", i, r.cookie, j)
		}
	}
}
