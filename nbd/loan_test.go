package nbd

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// lender is a backend that lends READ data from buffers of its own, which
// it reuses as soon as a loan comes back: released buffers are scribbled
// over at once, so a loan released while a reply still references it
// shows up as wrong bytes at the client. Each loan is three segments.
type lender struct {
	dev      *flatDev
	mu       sync.Mutex
	free     [][]byte
	lent     atomic.Int64
	returned atomic.Int64
	fail     error // complete lent reads with this (under mu)
	short    bool  // lend one byte less than asked (under mu)
}

func (l *lender) set(fail error, short bool) {
	l.mu.Lock()
	l.fail, l.short = fail, short
	l.mu.Unlock()
}

type testLoan struct {
	l    *lender
	buf  []byte
	segs [][]byte
	done atomic.Bool
}

func (x *testLoan) Segments() [][]byte { return x.segs }
func (x *testLoan) Release() {
	if x.done.Swap(true) {
		panic("loan released twice")
	}
	for i := range x.buf {
		x.buf[i] = 0xEE
	}
	x.l.mu.Lock()
	x.l.free = append(x.l.free, x.buf)
	x.l.mu.Unlock()
	x.l.returned.Add(1)
}

func (l *lender) Size() uint64 { return uint64(len(l.dev.b)) }
func (l *lender) Caps() Caps   { return CapFlush }
func (l *lender) Submit(r *Request) {
	if r.Op != OpRead || !r.CanLend() {
		Inline(l.dev).Submit(r)
		return
	}
	n := int(r.Length)
	l.mu.Lock()
	var buf []byte
	if k := len(l.free); k > 0 && cap(l.free[k-1]) >= n {
		buf, l.free = l.free[k-1][:n], l.free[:k-1]
	}
	fail, short := l.fail, l.short
	l.mu.Unlock()
	if buf == nil {
		buf = make([]byte, n)
	}
	copy(buf, l.dev.b[r.Offset:])
	a, b := n/3, 2*n/3
	x := &testLoan{l: l, buf: buf, segs: [][]byte{buf[:a], buf[a:b], buf[b:]}}
	if short {
		x.segs[2] = x.segs[2][:len(x.segs[2])-1]
	}
	l.lent.Add(1)
	r.Lend(x)
	go r.Complete(fail)
}

func newLender(regions, region int) *lender {
	l := &lender{dev: newFlat(regions * region)}
	for i := range regions {
		copy(l.dev.b[i*region:], pattern(region, byte(i)))
	}
	return l
}

// TestLoansSentAndReleased: lent READ data reaches the client intact over
// every transport and reply style, spliced or copied, and every loan is
// released exactly once, never while the peer may still read it.
func TestLoansSentAndReleased(t *testing.T) {
	const region, regions = 1 << 20, 12
	for _, tc := range []struct {
		name       string
		mode       ZeroCopy
		tcp        bool
		structured bool
		spliced    bool
	}{
		{"unix-zero-copy", ZeroCopyUnix, false, false, true},
		{"unix-zero-copy-structured", ZeroCopyUnix, false, true, true},
		{"unix-copy", ZeroCopyOff, false, true, false},
		{"tcp", ZeroCopyUnix, true, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := newLender(regions, region)
			s := NewServer(Config{ZeroCopy: tc.mode, SendBuffer: 4 << 20, MaxInflight: 4})
			s.AddExport(Export{Backend: l})
			c := dialTest(t, s, tc.tcp)
			c.open("", tc.structured)
			c.c.SetDeadline(time.Now().Add(60 * time.Second))
			const n = 48
			c.slowReads(n, regions, region)
			if got := s.spliced.Load() > 0; got != tc.spliced {
				t.Fatalf("spliced = %v, want %v", got, tc.spliced)
			}
			c.c.Close()
			if err := s.Shutdown(context.Background()); err != nil {
				t.Fatal(err)
			}
			if lent, back := l.lent.Load(), l.returned.Load(); lent != n || back != lent {
				t.Fatalf("%d loans, %d released; want %d each", lent, back, n)
			}
		})
	}
}

// TestLoanFailures: a failed read and a loan of the wrong length both
// reach the client as errors, and their loans are released.
func TestLoanFailures(t *testing.T) {
	for _, tc := range []struct {
		name  string
		fail  error
		short bool
		want  Errno
	}{
		{"backend error", errors.New("boom"), false, ErrIO},
		{"short loan", nil, true, ErrIO},
		{"errno kept", ErrNoSpace, false, ErrNoSpace},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := newLender(2, 1<<20)
			l.set(tc.fail, tc.short)
			s := NewServer(Config{ZeroCopy: ZeroCopyUnix})
			s.AddExport(Export{Backend: l})
			c := dialTest(t, s, false)
			c.open("", true)
			c.c.SetDeadline(time.Now().Add(30 * time.Second))
			c.send(cmdRead, 0, 7, 0, 1<<20, nil)
			if r := c.recv(0); r.errno != uint32(tc.want) || len(r.data) != 0 {
				t.Fatalf("errno %d with %d bytes, want errno %d and no data", r.errno, len(r.data), tc.want)
			}
			// The connection carries on.
			l.set(nil, false)
			c.send(cmdRead, 0, 8, 1<<20, 1<<20, nil)
			if r := c.recv(0); r.errno != 0 || !bytes.Equal(r.data, pattern(1<<20, 1)) {
				t.Fatalf("next read: errno %d, or wrong bytes", r.errno)
			}
			c.c.Close()
			s.Shutdown(context.Background())
			if lent, back := l.lent.Load(), l.returned.Load(); lent != 2 || back != 2 {
				t.Fatalf("%d loans, %d released", lent, back)
			}
		})
	}
}

// TestLoansOfAGonePeer: a client that hangs up with spliced replies still
// unread frees them (its queue is purged), so the loans come back.
func TestLoansOfAGonePeer(t *testing.T) {
	const region = 1 << 20
	l := newLender(8, region)
	s := NewServer(Config{ZeroCopy: ZeroCopyUnix, SendBuffer: 16 << 20})
	s.AddExport(Export{Backend: l})
	c := dialTest(t, s, false)
	c.open("", false)
	for i := range 8 {
		c.send(cmdRead, 0, uint64(i), uint64(i*region), region, nil)
	}
	deadline := time.Now().Add(10 * time.Second)
	for s.spliced.Load() < 8*region && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if s.spliced.Load() == 0 {
		t.Fatal("nothing spliced")
	}
	c.c.Close() // unread
	ctx, cancel := context.WithTimeout(context.Background(), loanDrainWait)
	defer cancel()
	if err := s.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	if lent, back := l.lent.Load(), l.returned.Load(); back != lent {
		t.Fatalf("%d loans, %d released", lent, back)
	}
}

// Requests outside a connection never take loans: their callers would not
// know to release one.
func TestNoLoansOutsideConnections(t *testing.T) {
	l := newLender(1, 1<<20)
	r := &Request{Op: OpRead, Length: 4096, Data: make([]byte, 4096)}
	if err := Do(l, r); err != nil {
		t.Fatal(err)
	}
	if l.lent.Load() != 0 || !bytes.Equal(r.Data, pattern(1<<20, 0)[:4096]) {
		t.Fatal("a loan went to a request outside a connection")
	}
}
