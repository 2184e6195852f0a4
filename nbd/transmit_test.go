package nbd

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"slices"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = seed + byte(i*7)
	}
	return b
}

func TestReadWriteSimpleAndStructured(t *testing.T) {
	dev := newFlat(1 << 20)
	s := newTestServer(t, Export{Backend: Inline(dev)})
	for _, structured := range []bool{false, true} {
		c := connect(t, s)
		size, flags := c.open("", structured)
		if size != 1<<20 {
			t.Fatalf("size %d", size)
		}
		want := FlagHasFlags | FlagSendFlush | FlagSendFUA | FlagSendTrim | FlagSendWriteZeroes |
			FlagSendFastZero | FlagCanMultiConn | FlagSendCache
		if structured {
			want |= FlagSendDF
		}
		if flags != want {
			t.Fatalf("flags %#x, want %#x", flags, want)
		}
		data := pattern(8192, 3)
		c.send(cmdWrite, 0, 1, 4096, 8192, data)
		if r := c.recv(0); r.errno != 0 || r.cookie != 1 {
			t.Fatalf("write: %+v", r)
		}
		c.send(cmdRead, cmdFlagDF&^boolFlag(!structured, cmdFlagDF), 2, 4096, 8192, nil)
		r := c.recv(8192)
		if r.errno != 0 || r.cookie != 2 || !bytes.Equal(r.data, data) || r.structured != structured {
			t.Fatalf("read back: errno %d structured %v equal %v", r.errno, r.structured, bytes.Equal(r.data, data))
		}
		if structured && r.offset != 4096 {
			t.Fatalf("OFFSET_DATA offset %d", r.offset)
		}
		c.send(cmdRead, 0, 3, 0, 0, nil) // zero-length read: valid, empty
		if r := c.recv(0); r.errno != 0 || len(r.data) != 0 {
			t.Fatalf("zero-length read: %+v", r)
		}
	}
}

func boolFlag(b bool, f uint16) uint16 {
	if b {
		return f
	}
	return 0
}

func TestCommands(t *testing.T) {
	dev := newFlat(1 << 20)
	s := newTestServer(t, Export{Backend: Inline(dev)})
	c := connect(t, s)
	c.open("", true)
	c.send(cmdWrite, cmdFlagFUA, 1, 0, 16384, pattern(16384, 1))
	if r := c.recv(0); r.errno != 0 {
		t.Fatalf("FUA write: %+v", r)
	}
	if _, _, fuas := dev.state(); fuas != 1 {
		t.Fatalf("FUA write reached the device as %d FUA writes", fuas)
	}
	c.send(cmdFlush, 0, 2, 0, 0, nil)
	if r := c.recv(0); r.errno != 0 {
		t.Fatalf("flush: %+v", r)
	}
	if _, flushes, _ := dev.state(); flushes != 1 {
		t.Fatalf("flush reached the device %d times", flushes)
	}
	c.send(cmdTrim, 0, 3, 0, 4096, nil)
	c.send(cmdWriteZeroes, cmdFlagNoHole, 4, 8192, 4096, nil)
	c.send(cmdWriteZeroes, cmdFlagFastZero, 5, 12288, 100, nil)
	c.send(cmdCache, 0, 6, 0, 65536, nil)
	for range 4 {
		if r := c.recv(0); r.errno != 0 {
			t.Fatalf("reply %+v", r)
		}
	}
	b, _, _ := dev.state()
	if !bytes.Equal(b[:4096], make([]byte, 4096)) || !bytes.Equal(b[8192:12388], make([]byte, 4196)) {
		t.Fatal("trim/zeroes left data behind")
	}
	if !bytes.Equal(b[4096:8192], pattern(16384, 1)[4096:8192]) || b[12388] == 0 {
		t.Fatal("trim/zeroes touched data outside their range")
	}
	// Block status: blocks 0, 2 are zero (holes), 1 and 3 data; beyond 16K zero.
	c.send(cmdBlockStatus, 0, 7, 0, 32768, nil)
	r := c.recv(0)
	want := []Extent{{4096, 3}, {4096, 0}, {4096, 3}, {4096, 0}, {16384, 3}}
	if r.errno != 0 || r.ctxID != metaBaseAllocID || !slices.Equal(r.extents, want) {
		t.Fatalf("block status %+v, want %+v", r, want)
	}
	c.send(cmdBlockStatus, cmdFlagReqOne, 8, 4096, 32768, nil)
	if r := c.recv(0); len(r.extents) != 1 || r.extents[0] != (Extent{4096, 0}) {
		t.Fatalf("REQ_ONE: %+v", r.extents)
	}
	// DISC: the server closes after answering what is in flight.
	c.send(cmdDisc, 0, 9, 0, 0, nil)
	c.expectClosed()
}

func TestBadRequests(t *testing.T) {
	const size = 1 << 20
	s := newTestServer(t, Export{Backend: Inline(newFlat(size))},
		Export{Name: "ro", Backend: Inline(newFlat(size)), ReadOnly: true},
		Export{Name: "bare", Backend: Inline(bareDev{newFlat(size)})})
	type req struct {
		name    string
		export  string
		simple  bool
		cmd     uint16
		flags   uint16
		off     uint64
		length  uint32
		payload bool
		want    Errno
	}
	cases := []req{
		{"unknown command", "", false, 42, 0, 0, 512, false, ErrInvalid},
		{"unknown flag", "", false, cmdRead, 1 << 9, 0, 512, false, ErrInvalid},
		{"DF on write", "", false, cmdWrite, cmdFlagDF, 0, 512, true, ErrInvalid},
		{"DF without structured", "", true, cmdRead, cmdFlagDF, 0, 512, false, ErrInvalid},
		{"NO_HOLE on trim", "", false, cmdTrim, cmdFlagNoHole, 0, 512, false, ErrInvalid},
		{"read too long", "", false, cmdRead, 0, 0, MaxPayload + 1, false, ErrOverflow},
		{"read too long simple", "", true, cmdRead, 0, 0, MaxPayload + 1, false, ErrOverflow},
		{"write too long", "", false, cmdWrite, 0, 0, MaxPayload + 4096, true, ErrInvalid},
		{"read beyond end", "", false, cmdRead, 0, size - 512, 1024, false, ErrInvalid},
		{"read offset overflow", "", false, cmdRead, 0, 1<<64 - 256, 512, false, ErrInvalid},
		{"write beyond end", "", false, cmdWrite, 0, size, 512, true, ErrNoSpace},
		{"zeroes beyond end", "", false, cmdWriteZeroes, 0, size - 1, 2, false, ErrNoSpace},
		{"trim beyond end", "", false, cmdTrim, 0, size, 1, false, ErrInvalid},
		{"flush with offset", "", false, cmdFlush, 0, 512, 0, false, ErrInvalid},
		{"block status zero length", "", false, cmdBlockStatus, 0, 0, 0, false, ErrInvalid},
		{"write read-only", "ro", false, cmdWrite, 0, 0, 4096, true, ErrPerm},
		{"trim read-only", "ro", false, cmdTrim, 0, 0, 4096, false, ErrPerm},
		{"zeroes read-only", "ro", true, cmdWriteZeroes, 0, 0, 4096, false, ErrPerm},
		{"trim not advertised", "bare", false, cmdTrim, 0, 0, 4096, false, ErrInvalid},
		{"flush not advertised", "bare", false, cmdFlush, 0, 0, 0, false, ErrInvalid},
		{"FUA not advertised", "bare", false, cmdWrite, cmdFlagFUA, 0, 512, true, ErrInvalid},
		{"fast zero not advertised", "bare", false, cmdWriteZeroes, cmdFlagFastZero, 0, 512, false, ErrInvalid},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := connect(t, s)
			c.open(tc.export, !tc.simple)
			var p []byte
			if tc.payload {
				p = make([]byte, tc.length)
			}
			c.send(tc.cmd, tc.flags, 11, tc.off, tc.length, p)
			r := c.recv(0)
			if Errno(r.errno) != tc.want || r.cookie != 11 || len(r.data) != 0 {
				t.Fatalf("got errno %d cookie %d data %d, want errno %d", r.errno, r.cookie, len(r.data), tc.want)
			}
			if !tc.simple && r.msg == "" {
				t.Fatal("structured error without a message")
			}
			// The connection survives and still serves.
			c.send(cmdRead, 0, 12, 0, 512, nil)
			if r := c.recv(512); r.errno != 0 || r.cookie != 12 || len(r.data) != 512 {
				t.Fatalf("after error: %+v", r)
			}
		})
	}
}

// bareDev hides every optional interface of flatDev.
type bareDev struct{ d *flatDev }

func (b bareDev) Size() uint64                             { return b.d.Size() }
func (b bareDev) ReadAt(p []byte, off int64) (int, error)  { return b.d.ReadAt(p, off) }
func (b bareDev) WriteAt(p []byte, off int64) (int, error) { return b.d.WriteAt(p, off) }

func TestBadMagicClosesOnlyThatConnection(t *testing.T) {
	s := newTestServer(t, Export{Backend: Inline(newFlat(1 << 20))})
	good := connect(t, s)
	good.open("", true)
	bad := connect(t, s)
	bad.open("", true)
	bad.write(bytes.Repeat([]byte{0xde, 0xad}, 14))
	bad.expectClosed()
	good.send(cmdRead, 0, 1, 0, 4096, nil)
	if r := good.recv(4096); r.errno != 0 {
		t.Fatalf("other connection disturbed: %+v", r)
	}
}

func TestBackendErrorsReachClient(t *testing.T) {
	dev := newFlat(1 << 20)
	s := newTestServer(t, Export{Backend: Inline(dev)})
	for _, tc := range []struct {
		err  error
		want Errno
	}{
		{syscall.ENOSPC, ErrNoSpace},
		{syscall.EDQUOT, ErrNoSpace},
		{syscall.EROFS, ErrPerm},
		{errors.New("librbd exploded"), ErrIO},
		{ErrShutdown, ErrShutdown},
	} {
		dev.mu.Lock()
		dev.err = tc.err
		dev.mu.Unlock()
		for _, structured := range []bool{false, true} {
			c := connect(t, s)
			c.open("", structured)
			c.send(cmdRead, 0, 1, 0, 4096, nil)
			c.send(cmdWrite, 0, 2, 0, 512, make([]byte, 512))
			c.send(cmdFlush, 0, 3, 0, 0, nil)
			for range 3 {
				// A failed READ carries no data, simple or structured:
				// the error is known before anything is sent.
				if r := c.recv(4096); Errno(r.errno) != tc.want || len(r.data) != 0 {
					t.Fatalf("%v structured=%v: %+v", tc.err, structured, r)
				}
			}
		}
	}
}

func TestOutOfOrderCompletion(t *testing.T) {
	a := newAsync(1 << 20)
	s := newTestServer(t, Export{Backend: a})
	c := connect(t, s)
	c.open("", true)
	for i := range 8 {
		c.send(cmdRead, 0, uint64(i), uint64(i)*4096, 4096, nil)
	}
	held := a.wait(t, 8) // all 8 reached the backend before any completed
	for i := len(held) - 1; i >= 0; i-- {
		a.finish(held[i], nil)
		if r := c.recv(0); r.cookie != uint64(i) {
			t.Fatalf("reply cookie %d, want %d (completion order)", r.cookie, i)
		}
	}
}

func TestMultiConnFlushCoversOtherConnections(t *testing.T) {
	a := newAsync(1 << 20)
	s := newTestServer(t, Export{Backend: a})
	c1, c2 := connect(t, s), connect(t, s)
	if _, f := c1.open("", true); f&FlagCanMultiConn == 0 {
		t.Fatal("multi-conn not advertised")
	}
	c2.open("", true)
	c1.send(cmdWrite, 0, 1, 0, 4096, pattern(4096, 9))
	w := a.wait(t, 1)[0]
	a.finish(w, nil)
	c1.recv(0)
	c2.send(cmdFlush, 0, 2, 0, 0, nil)
	f := a.wait(t, 1)[0]
	// One backend serves both: the flush lands where the write did.
	if f.Op != OpFlush {
		t.Fatalf("op %v", f.Op)
	}
	a.finish(f, nil)
	if r := c2.recv(0); r.errno != 0 {
		t.Fatalf("flush: %+v", r)
	}
	c2.send(cmdRead, 0, 3, 0, 4096, nil)
	a.finish(a.wait(t, 1)[0], nil)
	if r := c2.recv(0); !bytes.Equal(r.data, pattern(4096, 9)) {
		t.Fatal("write on one connection not visible on the other")
	}
}

func TestInflightLimit(t *testing.T) {
	a := newAsync(1 << 20)
	s := NewServer(Config{MaxInflight: 2})
	s.AddExport(Export{Backend: a})
	c := connect(t, s)
	c.open("", false)
	for i := range 3 {
		c.send(cmdRead, 0, uint64(i), 0, 512, nil)
	}
	held := a.wait(t, 2)
	select {
	case r := <-a.got:
		t.Fatalf("third request %d submitted past MaxInflight=2", r.cookie)
	case <-time.After(100 * time.Millisecond):
	}
	a.finish(held[0], nil)
	a.finish(a.wait(t, 1)[1], nil) // the third one arrives once a slot frees
	a.finish(held[1], nil)
	for range 3 {
		if r := c.recv(512); r.errno != 0 {
			t.Fatal(r)
		}
	}
	s.Shutdown(context.Background())
}

func TestShutdownFinishesInflight(t *testing.T) {
	a := newAsync(1 << 20)
	s := NewServer(Config{})
	s.AddExport(Export{Backend: a})
	c := connect(t, s)
	c.open("", true)
	c.send(cmdWrite, 0, 5, 0, 4096, pattern(4096, 1))
	w := a.wait(t, 1)[0]
	done := make(chan error)
	go func() { done <- s.Shutdown(context.Background()) }()
	select {
	case err := <-done:
		t.Fatalf("Shutdown returned (%v) with a request in flight", err)
	case <-time.After(100 * time.Millisecond):
	}
	a.finish(w, nil)
	if r := c.recv(0); r.errno != 0 || r.cookie != 5 {
		t.Fatalf("in-flight write not answered: %+v", r)
	}
	c.expectClosed()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	a2, b2 := socketpair(t)
	defer b2.Close()
	if err := s.ServeConn(a2); err != ErrServerClosed {
		t.Fatalf("ServeConn after Shutdown: %v", err)
	}
}

// A reply must not wait for the reader: here the reader is stuck in the
// middle of a write payload the client has not finished sending.
func TestReplyNotHeldByBlockedReader(t *testing.T) {
	for _, async := range []bool{false, true} {
		var be Backend = Inline(newFlat(1 << 20))
		a := newAsync(1 << 20)
		if async {
			be = a
		}
		s := newTestServer(t, Export{Backend: be})
		c := connect(t, s)
		c.open("", false)
		c.send(cmdWrite, 0, 1, 0, 4096, pattern(4096, 1))
		hdr := reqBytes(cmdWrite, 0, 2, 8192, 8192, pattern(4096, 2)) // half the payload
		c.write(hdr)
		if async {
			a.finish(a.wait(t, 1)[0], nil)
		}
		if r := c.recv(0); r.cookie != 1 || r.errno != 0 {
			t.Fatalf("async=%v: first reply %+v", async, r)
		}
		c.write(pattern(4096, 3))
		if async {
			a.finish(a.wait(t, 1)[0], nil)
		}
		if r := c.recv(0); r.cookie != 2 || r.errno != 0 {
			t.Fatalf("async=%v: second reply %+v", async, r)
		}
	}
}

// growingFake is an async backend whose size can change underneath.
type growingFake struct {
	*asyncFake
	size atomic.Uint64
}

func (g *growingFake) Size() uint64      { return g.size.Load() }
func (g *growingFake) Submit(r *Request) { r.Complete(nil) }

// TestNegotiatedFollowsResize: the kernel learns of a resize through
// netlink, not the handshake, and then uses the new space on its old
// connections; a handshake client keeps the size it was told.
func TestNegotiatedFollowsResize(t *testing.T) {
	g := &growingFake{asyncFake: newAsync(1 << 20)}
	g.size.Store(1 << 20)
	s := newTestServer(t, Export{Name: "", Backend: g})
	a, b := socketpair(t)
	go s.ServeNegotiated(a, "")
	kc := &tclient{t: t, c: b, br: bufio.NewReader(b)}
	t.Cleanup(func() { b.Close() })
	b.SetDeadline(time.Now().Add(20 * time.Second))
	uc := connect(t, s)
	uc.open("", false)

	kc.send(cmdWrite, 0, 1, 1<<20, 4096, make([]byte, 4096))
	if r := kc.recv(0); r.errno != uint32(ErrNoSpace) {
		t.Fatalf("write past the end before the resize: errno %d", r.errno)
	}
	g.size.Store(2 << 20)
	kc.send(cmdWrite, 0, 2, 1<<20, 4096, make([]byte, 4096))
	if r := kc.recv(0); r.errno != 0 {
		t.Fatalf("write in the new space on the kernel's connection: errno %d", r.errno)
	}
	uc.send(cmdRead, 0, 3, 1<<20, 4096, nil)
	if r := uc.recv(0); r.errno != uint32(ErrInvalid) {
		t.Fatalf("handshake client beyond its negotiated size: errno %d", r.errno)
	}
}

// TestBatchCompletion: requests of two connections completed through a
// Batch all get their replies once it is flushed, with their errors; and a
// request with no connection (nbd.Do) completes through it too.
func TestBatchCompletion(t *testing.T) {
	a := newAsync(1 << 20)
	s := newTestServer(t, Export{Backend: a})
	c1, c2 := connect(t, s), connect(t, s)
	c1.open("", false)
	c2.open("", false)
	for i := range 4 {
		c1.send(cmdRead, 0, uint64(i), uint64(i)*4096, 4096, nil)
		c2.send(cmdRead, 0, uint64(10+i), 0, 512, nil)
	}
	held := a.wait(t, 8)
	var b Batch
	for i, r := range held {
		var err error
		if i == 0 {
			err = ErrIO
		}
		b.Complete(r, err)
	}
	if len(b.conns) != 2 {
		t.Fatalf("batch remembers %d connections, want 2", len(b.conns))
	}
	b.Flush()
	errs := 0
	for _, c := range []struct {
		c *tclient
		n int
	}{{c1, 4096}, {c2, 512}} {
		for range 4 {
			if r := c.c.recv(c.n); r.errno != 0 {
				errs++
			}
		}
	}
	if errs != 1 {
		t.Fatalf("%d error replies, want 1", errs)
	}
	r := &Request{Op: OpFlush}
	fin := make(chan struct{})
	Go(a, r, func(*Request) { close(fin) })
	held = a.wait(t, 1)
	b.Complete(held[len(held)-1], nil)
	b.Flush()
	<-fin
}
