package nbd

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"net"
	"os"
	"sync/atomic"
	"testing"
	"time"
)

// counted counts the requests a server submitted: which server answered.
type counted struct {
	Backend
	n atomic.Int64
}

func (c *counted) Submit(r *Request) {
	c.n.Add(1)
	c.Backend.Submit(r)
}

// handoffServer is a server with idleAfter and be as its default export,
// shut down at the end of the test.
func handoffServer(t *testing.T, idleAfter time.Duration, be Backend) *Server {
	t.Helper()
	s := NewServer(Config{IdleAfter: idleAfter})
	if err := s.AddExport(Export{Backend: be}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		s.Shutdown(ctx)
	})
	return s
}

// negotiated serves one end of a socketpair with ServeNegotiated, as the
// daemon serves the kernel's sockets, and returns a client on the other
// end and where ServeNegotiated's result arrives.
func negotiated(t *testing.T, s *Server) (*tclient, <-chan error) {
	t.Helper()
	a, b := socketpair(t)
	served := make(chan error, 1)
	go func() { served <- s.ServeNegotiated(a, "") }()
	c := &tclient{t: t, c: b, br: bufio.NewReader(b)}
	t.Cleanup(func() { b.Close() })
	b.SetDeadline(time.Now().Add(30 * time.Second))
	return c, served
}

// takeOver releases p and serves every socket handed on s2, as the new
// daemon would.
func takeOver(t testing.TB, p *Paused, s2 *Server) []Handed {
	t.Helper()
	hs, err := serveHanded(p, s2)
	if err != nil {
		t.Fatal(err)
	}
	return hs
}

func serveHanded(p *Paused, s2 *Server) ([]Handed, error) {
	hs, err := p.Release()
	if err != nil {
		return nil, err
	}
	for _, h := range hs {
		nc, err := net.FileConn(h.File)
		h.File.Close()
		if err != nil {
			return nil, err
		}
		go s2.ServeNegotiated(nc, h.Export)
	}
	return hs, nil
}

// quiet asserts that nothing arrives for d: no reply, and above all no
// end of file.
func (c *tclient) quiet(d time.Duration) {
	c.t.Helper()
	c.c.SetReadDeadline(time.Now().Add(d))
	_, err := c.br.Peek(1)
	c.c.SetReadDeadline(time.Now().Add(30 * time.Second))
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		c.t.Fatalf("the socket was to stay quiet; read: %v", err)
	}
}

// pauseAsync runs Pause in the background.
func pauseAsync(s *Server, d time.Duration) <-chan pauseResult {
	ch := make(chan pauseResult, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), d)
		defer cancel()
		p, err := s.Pause(ctx)
		ch <- pauseResult{p, err}
	}()
	return ch
}

type pauseResult struct {
	p   *Paused
	err error
}

// notYet asserts that Pause is still waiting after d.
func notYet(t *testing.T, ch <-chan pauseResult, d time.Duration, why string) {
	t.Helper()
	select {
	case r := <-ch:
		t.Fatalf("Pause returned (%v) %s", r.err, why)
	case <-time.After(d):
	}
}

// pauseNow pauses s, failing the test if that takes more than 5 s.
func pauseNow(t *testing.T, s *Server) *Paused {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	p, err := s.Pause(ctx)
	if err != nil {
		t.Fatalf("Pause: %v", err)
	}
	return p
}

// TestHandoverSplitWrite: a WRITE whose header and half its payload
// arrived before Pause is read whole and answered by the old server
// before Pause returns; what the client sends during the pause waits in
// the socket for the new server; the client never sees an end of file,
// and the old server's Shutdown leaves the handed socket alone.
func TestHandoverSplitWrite(t *testing.T) {
	for _, idle := range []time.Duration{20 * time.Millisecond, 0} { // parked, or blocked in read(2)
		t.Run(fmtIdle(idle), func(t *testing.T) {
			dev := newFlat(1 << 20)
			oldB, newB := &counted{Backend: Inline(dev)}, &counted{Backend: Inline(dev)}
			s1 := handoffServer(t, idle, oldB)
			c, served := negotiated(t, s1)
			req := reqBytes(cmdWrite, 0, 1, 8192, 8192, pattern(8192, 1))
			cut := requestHeaderSize + 3000
			c.write(req[:cut])
			time.Sleep(100 * time.Millisecond) // the reader waits in the payload
			ch := pauseAsync(s1, 10*time.Second)
			notYet(t, ch, 200*time.Millisecond, "with a request half read")
			c.write(req[cut:])
			r := <-ch
			if r.err != nil {
				t.Fatalf("Pause: %v", r.err)
			}
			// Answered before Pause returned: the reply is in the socket.
			c.c.SetReadDeadline(time.Now().Add(time.Second))
			if rep := c.recv(0); rep.cookie != 1 || rep.errno != 0 {
				t.Fatalf("split write: %+v", rep)
			}
			c.c.SetReadDeadline(time.Now().Add(30 * time.Second))
			// Sent during the pause: waits for whoever reads next.
			c.send(cmdWrite, 0, 2, 0, 4096, pattern(4096, 2))
			c.quiet(100 * time.Millisecond)

			s2 := handoffServer(t, idle, newB)
			hs := takeOver(t, r.p, s2)
			if len(hs) != 1 || hs[0].Export != "" {
				t.Fatalf("handed %+v", hs)
			}
			if err := <-served; err != nil {
				t.Fatalf("old ServeNegotiated: %v", err)
			}
			// The old server is closed; shutting it down must not shut
			// down the socket it gave away.
			if err := s1.Shutdown(context.Background()); err != nil {
				t.Fatal(err)
			}
			x, y := socketpair(t)
			defer y.Close()
			if err := s1.ServeNegotiated(x, ""); err != ErrServerClosed {
				t.Fatalf("old server after Release: %v", err)
			}
			if rep := c.recv(0); rep.cookie != 2 || rep.errno != 0 {
				t.Fatalf("write sent during the pause: %+v", rep)
			}
			c.send(cmdWrite, 0, 3, 4096, 4096, pattern(4096, 3))
			c.send(cmdRead, 0, 4, 0, 16384, nil)
			if rep := c.recv(0); rep.cookie != 3 || rep.errno != 0 {
				t.Fatalf("write after the handover: %+v", rep)
			}
			want := append(append(pattern(4096, 2), pattern(4096, 3)...), pattern(8192, 1)...)
			if rep := c.recv(16384); rep.cookie != 4 || !bytes.Equal(rep.data, want) {
				t.Fatalf("read after the handover: cookie %d, data equal %v", rep.cookie, bytes.Equal(rep.data, want))
			}
			if o, n := oldB.n.Load(), newB.n.Load(); o != 1 || n != 3 {
				t.Fatalf("old server served %d requests, new %d; want 1 and 3", o, n)
			}
		})
	}
}

func fmtIdle(d time.Duration) string {
	if d == 0 {
		return "idle-default"
	}
	return "idle-" + d.String()
}

// TestHandoverReplyInFlight: Pause waits for a request held in the
// backend, returns once its reply has reached the socket, and the new
// server answers what follows.
func TestHandoverReplyInFlight(t *testing.T) {
	a := newAsync(1 << 20)
	s1 := handoffServer(t, 20*time.Millisecond, a)
	c, _ := negotiated(t, s1)
	c.send(cmdWrite, 0, 1, 0, 4096, pattern(4096, 1))
	c.send(cmdRead, 0, 2, 65536, 4096, nil)
	held := a.wait(t, 2)
	ch := pauseAsync(s1, 10*time.Second)
	notYet(t, ch, 200*time.Millisecond, "with two requests in the backend")
	a.finish(held[0], nil)
	notYet(t, ch, 100*time.Millisecond, "with a request in the backend")
	a.finish(held[1], nil)
	r := <-ch
	if r.err != nil {
		t.Fatal(r.err)
	}
	c.c.SetReadDeadline(time.Now().Add(time.Second))
	if rep := c.recv(0); rep.cookie != 1 || rep.errno != 0 {
		t.Fatalf("write: %+v", rep)
	}
	if rep := c.recv(4096); rep.cookie != 2 || len(rep.data) != 4096 {
		t.Fatalf("read: %+v", rep)
	}
	c.c.SetReadDeadline(time.Now().Add(30 * time.Second))
	c.send(cmdRead, 0, 3, 0, 4096, nil)
	select {
	case <-a.got:
		t.Fatal("a paused server submitted a request")
	case <-time.After(100 * time.Millisecond):
	}
	s2 := handoffServer(t, 20*time.Millisecond, a)
	takeOver(t, r.p, s2)
	a.finish(a.wait(t, 1)[0], nil)
	if rep := c.recv(4096); rep.cookie != 3 || !bytes.Equal(rep.data, pattern(4096, 1)) {
		t.Fatalf("read on the new server: %+v", rep)
	}
}

// gated holds the first request it is given in Submit until gate closes:
// the reader stops with the rest of a burst in its read buffer.
type gated struct {
	counted
	gate chan struct{}
	once atomic.Bool
}

func (g *gated) Submit(r *Request) {
	if !g.once.Swap(true) {
		<-g.gate
	}
	g.counted.Submit(r)
}

// TestHandoverReadAhead: a burst the reader has in its read buffer when
// Pause comes is served by the old server, none of it dropped; the
// requests sent after Pause go to the new one; every request is
// answered exactly once.
func TestHandoverReadAhead(t *testing.T) {
	dev := newFlat(1 << 20)
	oldB := &gated{counted: counted{Backend: Inline(dev)}, gate: make(chan struct{})}
	newB := &counted{Backend: Inline(dev)}
	s1 := handoffServer(t, 20*time.Millisecond, oldB)
	c, _ := negotiated(t, s1)
	ops, lens := map[uint64]uint16{}, map[uint64]int{}
	var burst []byte
	cookie := uint64(0)
	for i := range 12 { // 12 writes of 4 KiB and 12 reads: 50 KiB, one read
		cookie++
		burst = append(burst, reqBytes(cmdWrite, 0, cookie, uint64(i)*4096, 4096, pattern(4096, byte(i)))...)
		ops[cookie] = cmdWrite
	}
	for i := range 12 {
		cookie++
		burst = append(burst, reqBytes(cmdRead, 0, cookie, uint64(i)*4096, 4096, nil)...)
		ops[cookie], lens[cookie] = cmdRead, 4096
	}
	c.write(burst)
	for !oldB.once.Load() {
		time.Sleep(time.Millisecond) // until the reader is stuck in Submit
	}
	ch := pauseAsync(s1, 10*time.Second)
	for !s1.paused() {
		time.Sleep(time.Millisecond)
	}
	close(oldB.gate)
	r := <-ch
	if r.err != nil {
		t.Fatal(r.err)
	}
	if n := oldB.n.Load(); n != 24 {
		t.Fatalf("the old server served %d of the 24 requests it had read ahead", n)
	}
	// More, sent during the pause.
	for i := range 4 {
		cookie++
		c.send(cmdRead, 0, cookie, uint64(i)*4096, 4096, nil)
		ops[cookie], lens[cookie] = cmdRead, 4096
	}
	s2 := handoffServer(t, 20*time.Millisecond, newB)
	takeOver(t, r.p, s2)
	c.expectReplies(ops, lens, func(ck uint64, data []byte) {
		i := (ck - 13) % 12
		if ck > 24 {
			i = ck - 25
		}
		if !bytes.Equal(data, pattern(4096, byte(i))) {
			t.Fatalf("cookie %d: wrong data", ck)
		}
	})
	c.quiet(50 * time.Millisecond) // and no reply twice
	if n := newB.n.Load(); n != 4 {
		t.Fatalf("the new server served %d requests, want 4", n)
	}
}

// paused reports whether a pause is in force or under way.
func (s *Server) paused() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.pause != nil
}

// TestPauseResume: a handover refused halfway. Requests sent during the
// pause wait, and after Resume the old server answers each exactly once,
// on every connection; the server can be paused again.
func TestPauseResume(t *testing.T) {
	dev := newFlat(1 << 20)
	be := &counted{Backend: Inline(dev)}
	s := handoffServer(t, 20*time.Millisecond, be)
	c1, _ := negotiated(t, s)
	c2, _ := negotiated(t, s)
	for round := range 2 {
		p := pauseNow(t, s)
		if _, err := s.Pause(context.Background()); err != ErrPaused {
			t.Fatalf("second Pause: %v", err)
		}
		base := uint64(round * 10)
		c1.send(cmdWrite, 0, base+1, 0, 4096, pattern(4096, byte(round)))
		c2.send(cmdWrite, 0, base+2, 4096, 4096, pattern(4096, byte(round+1)))
		c1.quiet(50 * time.Millisecond)
		c2.quiet(time.Millisecond)
		n := be.n.Load()
		p.Resume()
		p.Resume() // no-op
		if _, err := p.Release(); err == nil {
			t.Fatal("Release after Resume succeeded")
		}
		if r := c1.recv(0); r.cookie != base+1 || r.errno != 0 {
			t.Fatalf("c1: %+v", r)
		}
		if r := c2.recv(0); r.cookie != base+2 || r.errno != 0 {
			t.Fatalf("c2: %+v", r)
		}
		c1.send(cmdRead, 0, base+3, 0, 8192, nil)
		want := append(pattern(4096, byte(round)), pattern(4096, byte(round+1))...)
		if r := c1.recv(8192); r.cookie != base+3 || !bytes.Equal(r.data, want) {
			t.Fatalf("read after Resume: %+v", r)
		}
		if got := be.n.Load() - n; got != 3 {
			t.Fatalf("%d requests served after Resume, want 3", got)
		}
		c1.quiet(20 * time.Millisecond)
		c2.quiet(time.Millisecond)
	}
}

// TestPauseDeadline: a pause that cannot drain in time (a request the
// backend holds; a request whose payload has not all arrived) fails
// when its context ends and leaves every connection reading.
func TestPauseDeadline(t *testing.T) {
	a := newAsync(1 << 20)
	s := handoffServer(t, 20*time.Millisecond, a)
	c, _ := negotiated(t, s)
	c.send(cmdWrite, 0, 1, 0, 4096, pattern(4096, 1))
	held := a.wait(t, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	t0 := time.Now()
	if _, err := s.Pause(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Pause with a request held: %v", err)
	}
	if d := time.Since(t0); d > 2*time.Second {
		t.Fatalf("Pause took %v to give up", d)
	}
	if s.paused() {
		t.Fatal("a failed Pause left the server paused")
	}
	c.send(cmdRead, 0, 2, 0, 4096, nil) // read on while the write is held
	a.finish(a.wait(t, 1)[1], nil)
	if r := c.recv(4096); r.cookie != 2 {
		t.Fatalf("read after the failed pause: %+v", r)
	}
	a.finish(held[0], nil)
	if r := c.recv(0); r.cookie != 1 || r.errno != 0 {
		t.Fatalf("held write: %+v", r)
	}

	// Half a request: Pause waits for the rest, which does not come.
	req := reqBytes(cmdWrite, 0, 3, 8192, 4096, pattern(4096, 3))
	c.write(req[:100])
	ctx2, cancel2 := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel2()
	if _, err := s.Pause(ctx2); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Pause with half a request: %v", err)
	}
	c.write(req[100:])
	a.finish(a.wait(t, 1)[0], nil)
	if r := c.recv(0); r.cookie != 3 || r.errno != 0 {
		t.Fatalf("write completed after the failed pause: %+v", r)
	}
	a.mu.Lock()
	applied := bytes.Equal(a.data[8192:8192+4096], pattern(4096, 3))
	a.mu.Unlock()
	if !applied {
		t.Fatal("split write not applied")
	}
	p := pauseNow(t, s) // everything answered: now it drains
	p.Resume()
	c.send(cmdFlush, 0, 4, 0, 0, nil)
	a.finish(a.wait(t, 1)[0], nil)
	if r := c.recv(0); r.cookie != 4 || r.errno != 0 {
		t.Fatalf("flush after Resume: %+v", r)
	}
}
