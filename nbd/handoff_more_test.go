package nbd

import (
	"bufio"
	"bytes"
	"context"
	"math/rand/v2"
	"net"
	"sync/atomic"
	"testing"
	"time"
)

// TestHandoverManyConnections: several connections per server, as the
// kernel opens (2-4), their readers parked idle or blocked in read(2),
// and one that begins during the pause: Pause wakes the parked ones
// (they would sleep until the next request otherwise), the blocked ones
// stop when their read times out (IdleAfter), every one is handed over,
// and each goes on serving on the new server.
func TestHandoverManyConnections(t *testing.T) {
	dev := newFlat(1 << 20)
	for _, idle := range []time.Duration{20 * time.Millisecond, 0} {
		t.Run(fmtIdle(idle), func(t *testing.T) {
			s1 := handoffServer(t, idle, Inline(dev))
			var cs []*tclient
			for i := range 4 {
				c, _ := negotiated(t, s1)
				c.send(cmdWrite, 0, 1, uint64(i)*4096, 4096, pattern(4096, byte(i)))
				if r := c.recv(0); r.errno != 0 {
					t.Fatalf("conn %d: %+v", i, r)
				}
				cs = append(cs, c)
			}
			time.Sleep(150 * time.Millisecond) // parked with 20 ms; in read(2) with 500
			t0 := time.Now()
			p := pauseNow(t, s1)
			if d := time.Since(t0); d > s1.cfg.IdleAfter+time.Second {
				t.Fatalf("Pause of idle readers took %v", d)
			}
			late, _ := negotiated(t, s1) // joins the pause: reads nothing
			late.send(cmdRead, 0, 9, 0, 4096, nil)
			late.quiet(50 * time.Millisecond)
			cs = append(cs, late)
			s2 := handoffServer(t, idle, Inline(dev))
			if hs := takeOver(t, p, s2); len(hs) != 5 {
				t.Fatalf("%d connections handed, want 5", len(hs))
			}
			if n := s1.pool.idle.count(); n != 0 {
				t.Fatalf("%d sockets of the old server still watched for idling", n)
			}
			if r := late.recv(4096); r.cookie != 9 || !bytes.Equal(r.data, pattern(4096, 0)) {
				t.Fatalf("late connection: %+v", r)
			}
			for i, c := range cs[:4] {
				c.send(cmdRead, 0, 2, uint64(i)*4096, 4096, nil)
				if r := c.recv(4096); r.cookie != 2 || !bytes.Equal(r.data, pattern(4096, byte(i))) {
					t.Fatalf("conn %d on the new server: cookie %d", i, r.cookie)
				}
			}
		})
	}
}

// TestPauseNeverIdle: with IdleAfter negative a reader blocked in read(2)
// on a quiet socket cannot be stopped (only data or shutdown(2) would
// wake it), so Pause fails at its deadline, leaving it reading.
func TestPauseNeverIdle(t *testing.T) {
	s := handoffServer(t, -1, Inline(newFlat(1<<20)))
	c, _ := negotiated(t, s)
	c.send(cmdRead, 0, 1, 0, 4096, nil)
	c.recv(4096)
	time.Sleep(50 * time.Millisecond) // let the reader block in read(2)
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if p, err := s.Pause(ctx); err == nil {
		// A loaded machine: the reader reached its boundary check
		// before blocking. Nothing to show then.
		p.Resume()
		t.Skip("the reader had not blocked in read(2) yet")
	}
	c.send(cmdRead, 0, 2, 0, 4096, nil)
	if r := c.recv(4096); r.cookie != 2 {
		t.Fatalf("after the failed pause: %+v", r)
	}
	c.send(cmdRead, 0, 3, 0, 4096, nil) // read on to the next boundary
	if r := c.recv(4096); r.cookie != 3 {
		t.Fatalf("after the failed pause: %+v", r)
	}
}

// TestHandoverSplitRefusedWrite: a WRITE refused for its range, whose
// payload is skipped rather than read, is skipped whole across a pause
// too: the new server finds the next request where it starts. The
// socket comes without the old server's receive timeout, which would
// fail a new server that never parks.
func TestHandoverSplitRefusedWrite(t *testing.T) {
	dev := newFlat(1 << 20)
	s1 := handoffServer(t, 20*time.Millisecond, Inline(dev))
	c, _ := negotiated(t, s1)
	req := reqBytes(cmdWrite, 0, 1, 1<<20, 8192, pattern(8192, 1)) // beyond the end
	c.write(req[:4000])
	time.Sleep(100 * time.Millisecond) // parked in the payload
	ch := pauseAsync(s1, 10*time.Second)
	notYet(t, ch, 200*time.Millisecond, "with a payload half skipped")
	c.write(req[4000:])
	r := <-ch
	if r.err != nil {
		t.Fatal(r.err)
	}
	if rep := c.recv(0); rep.cookie != 1 || Errno(rep.errno) != ErrNoSpace {
		t.Fatalf("refused write: %+v", rep)
	}
	c.send(cmdRead, 0, 2, 0, 4096, nil)
	takeOver(t, r.p, handoffServer(t, -1, Inline(dev)))
	if rep := c.recv(4096); rep.cookie != 2 || rep.errno != 0 {
		t.Fatalf("next request on the new server: %+v", rep)
	}
	time.Sleep(100 * time.Millisecond) // past the old IdleAfter
	c.send(cmdRead, 0, 3, 0, 4096, nil)
	if rep := c.recv(4096); rep.cookie != 3 || rep.errno != 0 {
		t.Fatalf("after a quiet spell on the new server: %+v", rep)
	}
}

// count is how many sockets wait in the watcher.
func (iw *idleWatcher) count() int {
	iw.mu.Lock()
	defer iw.mu.Unlock()
	return len(iw.waiters)
}

// TestPauseAndShutdown: Pause on a closed or closing server fails;
// Shutdown ends a pause under way or in force, the connections read on
// to their end; Shutdown after Resume closes as usual.
func TestPauseAndShutdown(t *testing.T) {
	t.Run("after", func(t *testing.T) {
		s := handoffServer(t, 20*time.Millisecond, Inline(newFlat(1<<20)))
		negotiated(t, s)
		s.Shutdown(context.Background())
		if _, err := s.Pause(context.Background()); err != ErrServerClosed {
			t.Fatalf("Pause after Shutdown: %v", err)
		}
	})
	t.Run("during", func(t *testing.T) {
		a := newAsync(1 << 20)
		s := handoffServer(t, 20*time.Millisecond, a)
		c, _ := negotiated(t, s)
		c.send(cmdWrite, 0, 1, 0, 4096, pattern(4096, 1))
		held := a.wait(t, 1)
		ch := pauseAsync(s, 10*time.Second)
		for !s.paused() {
			time.Sleep(time.Millisecond)
		}
		done := make(chan error, 1)
		go func() { done <- s.Shutdown(context.Background()) }()
		if r := <-ch; r.err != ErrServerClosed {
			t.Fatalf("Pause under way at Shutdown: %v", r.err)
		}
		a.finish(held[0], nil)
		if r := c.recv(0); r.cookie != 1 || r.errno != 0 {
			t.Fatalf("held write: %+v", r)
		}
		c.expectClosed()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	})
	t.Run("paused", func(t *testing.T) {
		s := handoffServer(t, 20*time.Millisecond, Inline(newFlat(1<<20)))
		c, served := negotiated(t, s)
		c.send(cmdRead, 0, 1, 0, 4096, nil) // served: in transmission
		c.recv(4096)
		p := pauseNow(t, s)
		if err := s.Shutdown(context.Background()); err != nil {
			t.Fatal(err)
		}
		c.expectClosed()
		if err := <-served; err != nil {
			t.Fatalf("ServeNegotiated: %v", err)
		}
		if _, err := p.Release(); err != ErrServerClosed {
			t.Fatalf("Release after Shutdown: %v", err)
		}
		p.Resume()
	})
	t.Run("resumed", func(t *testing.T) {
		s := handoffServer(t, 20*time.Millisecond, Inline(newFlat(1<<20)))
		c, _ := negotiated(t, s)
		p := pauseNow(t, s)
		c.send(cmdRead, 0, 1, 0, 4096, nil)
		p.Resume()
		if r := c.recv(4096); r.cookie != 1 {
			t.Fatalf("after Resume: %+v", r)
		}
		if err := s.Shutdown(context.Background()); err != nil {
			t.Fatal(err)
		}
		c.expectClosed()
	})
}

// TestPauseNetConn: a connection read through its net.Conn (no socket
// descriptor of its own, so no idle parking) is stopped by a deadline;
// one that cuts a message short is cleared and the message read whole.
// Release refuses such a connection, and a handshake one; Resume then
// carries on.
func TestPauseNetConn(t *testing.T) {
	dev := newFlat(1 << 20)
	s := handoffServer(t, 20*time.Millisecond, Inline(dev))
	a, b := net.Pipe()
	go s.ServeNegotiated(a, "")
	c := &tclient{t: t, c: b, br: bufio.NewReader(b)}
	t.Cleanup(func() { b.Close() })
	b.SetDeadline(time.Now().Add(30 * time.Second))
	req := reqBytes(cmdWrite, 0, 1, 0, 8192, pattern(8192, 1))
	c.write(req[:5000]) // returns once the server has read it
	ch := pauseAsync(s, 10*time.Second)
	notYet(t, ch, 200*time.Millisecond, "with a request half read")
	c.write(req[5000:])
	if r := c.recv(0); r.cookie != 1 || r.errno != 0 {
		t.Fatalf("split write: %+v", r)
	}
	r := <-ch
	if r.err != nil {
		t.Fatal(r.err)
	}
	if _, err := r.p.Release(); err == nil {
		t.Fatal("Release handed a connection without a descriptor")
	}
	r.p.Resume()
	c.send(cmdRead, 0, 2, 0, 8192, nil)
	if r := c.recv(8192); r.cookie != 2 || !bytes.Equal(r.data, pattern(8192, 1)) {
		t.Fatalf("after Resume: %+v", r)
	}
	// At a boundary the deadline stops it at once; Resume clears it.
	for range 3 {
		p := pauseNow(t, s)
		p.Resume()
	}
	c.send(cmdRead, 0, 3, 0, 4096, nil)
	if r := c.recv(4096); r.cookie != 3 {
		t.Fatalf("after more pauses: %+v", r)
	}

	hc := connect(t, s)
	hc.open("", true)
	p := pauseNow(t, s)
	if _, err := p.Release(); err == nil {
		t.Fatal("Release handed a connection that negotiated a handshake")
	}
	p.Resume()
	hc.send(cmdRead, 0, 4, 0, 4096, nil)
	if r := hc.recv(0); r.cookie != 4 || len(r.data) != 4096 {
		t.Fatalf("handshake connection after Resume: %+v", r)
	}
}

// lendDev lends every large READ's data (copied, then scribbled over
// once returned: a loan released while the peer may still read it shows
// as wrong data) and completes it from another goroutine; the rest it
// serves inline.
type lendDev struct {
	dev        *flatDev
	lent, back atomic.Int64
}

type scribbled struct {
	d    *lendDev
	segs [][]byte
	buf  []byte
}

func (x *scribbled) Segments() [][]byte { return x.segs }
func (x *scribbled) Release() {
	for i := range x.buf {
		x.buf[i] = 0xEE
	}
	x.d.back.Add(1)
}

func (l *lendDev) Size() uint64 { return l.dev.Size() }
func (l *lendDev) Caps() Caps   { return CapFlush | CapMultiConn }
func (l *lendDev) Submit(r *Request) {
	if r.Op != OpRead || !r.CanLend() || r.Length < zeroCopyMin {
		Inline(l.dev).Submit(r)
		return
	}
	buf := make([]byte, r.Length)
	l.dev.ReadAt(buf, int64(r.Offset))
	h := len(buf) / 2
	l.lent.Add(1)
	r.Lend(&scribbled{d: l, segs: [][]byte{buf[:h], buf[h:]}, buf: buf})
	go r.Complete(nil)
}

// TestHandoverUnderLoad: clients keep two connections busy with writes
// and reads of up to 128 KiB (spliced, lent, or sent directly by the
// backend) while their sockets are handed from server to server and
// pauses are refused halfway: no request is lost or answered twice, and
// every read returns what was written.
func TestHandoverUnderLoad(t *testing.T) {
	const size = 8 << 20
	for _, tc := range []struct {
		name string
		be   func(t *testing.T) Backend
	}{
		{"inline", func(*testing.T) Backend { return Inline(newFlat(size)) }},
		{"direct", func(t *testing.T) Backend {
			d := newForeign(size, 3)
			t.Cleanup(func() { close(d.work) }) // after every Shutdown
			return d
		}},
		{"loans", func(*testing.T) Backend { return &lendDev{dev: newFlat(size)} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			be := tc.be(t)
			s := handoffServer(t, 20*time.Millisecond, be)
			cs := []*tclient{}
			for range 2 {
				c, _ := negotiated(t, s)
				cs = append(cs, c)
			}
			var releases, resumes int
			done := make(chan struct{})
			t.Cleanup(func() { <-done }) // it reports to t
			go func() {
				defer close(done)
				for i := range 8 {
					time.Sleep(time.Duration(5+rand.IntN(30)) * time.Millisecond)
					ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
					p, err := s.Pause(ctx)
					cancel()
					if err != nil {
						t.Errorf("Pause %d: %v", i, err)
						return
					}
					time.Sleep(time.Duration(rand.IntN(5)) * time.Millisecond) // requests pile up
					if i%2 == 0 {
						p.Resume()
						resumes++
						continue
					}
					next := handoffServer(t, 20*time.Millisecond, be)
					hs, err := serveHanded(p, next)
					if err != nil || len(hs) != len(cs) {
						t.Errorf("handover %d: %d connections, want %d: %v", i, len(hs), len(cs), err)
						return
					}
					s = next
					releases++
				}
			}()
			want := make([]byte, size)
			region := size / len(cs)
			cookie := uint64(0)
			for round := 0; !isClosed(done); round++ {
				if round > 5000 {
					t.Fatal("handovers did not finish")
				}
				// Writes to distinct 128 KiB blocks of each connection's
				// region, then reads of them.
				offs := make([]map[uint64]int, len(cs))
				for ci, c := range cs {
					ops, o := map[uint64]uint16{}, map[uint64]int{}
					for range 12 {
						off := ci*region + rand.IntN(region/(128<<10))*(128<<10)
						n := 4096 << rand.IntN(6) // 4-128 KiB
						data := pattern(n, byte(round+off>>12))
						copy(want[off:], data)
						cookie++
						ops[cookie], o[cookie] = cmdWrite, off
						c.send(cmdWrite, 0, cookie, uint64(off), uint32(n), data)
						for ck, prev := range o { // a block written twice: the second wins only if served in order
							if prev == off && ck != cookie {
								delete(o, ck)
							}
						}
					}
					c.expectReplies(ops, map[uint64]int{}, nil)
					offs[ci] = o
				}
				for ci, c := range cs {
					ops, lens, at := map[uint64]uint16{}, map[uint64]int{}, map[uint64]int{}
					for _, off := range offs[ci] {
						cookie++
						n := 4096 << rand.IntN(6)
						ops[cookie], lens[cookie], at[cookie] = cmdRead, n, off
						c.send(cmdRead, 0, cookie, uint64(off), uint32(n), nil)
					}
					c.expectReplies(ops, lens, func(ck uint64, data []byte) {
						off := at[ck]
						if !bytes.Equal(data, want[off:off+len(data)]) {
							t.Fatalf("read of %d bytes at %d (cookie %d): not what was written", len(data), off, ck)
						}
					})
				}
			}
			if t.Failed() {
				return
			}
			if releases != 4 || resumes != 4 {
				t.Fatalf("%d handovers and %d refused ones, want 4 of each", releases, resumes)
			}
			for _, c := range cs {
				c.quiet(20 * time.Millisecond) // no reply twice
			}
			t.Logf("%d requests over %d handovers and %d resumed pauses", cookie, releases, resumes)
			if l, ok := be.(*lendDev); ok {
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				s.Shutdown(ctx)
				cancel()
				if l.lent.Load() == 0 || l.lent.Load() != l.back.Load() {
					t.Fatalf("%d loans lent, %d returned", l.lent.Load(), l.back.Load())
				}
			}
		})
	}
}

func isClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}
