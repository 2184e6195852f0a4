package nbd

import (
	"bufio"
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestSharedBudget: servers over one Shared hold at most its budget of
// payload in flight, past which a connection's next request waits for
// replies, except that a connection with nothing in flight always gets
// one; the budget is whole again once everything is answered.
func TestSharedBudget(t *testing.T) {
	const size = 32 << 10
	sh := NewShared(2 * size)
	dev := newAsync(1 << 20)
	cs := make([]*tclient, 2)
	for i := range cs {
		s := NewServer(Config{Shared: sh})
		s.AddExport(Export{Backend: dev})
		t.Cleanup(func() { s.Shutdown(context.Background()) })
		a, b := socketpair(t)
		go s.ServeNegotiated(a, "")
		cs[i] = &tclient{t: t, c: b, br: bufio.NewReader(b)}
		t.Cleanup(func() { b.Close() })
		b.SetDeadline(time.Now().Add(30 * time.Second))
	}
	for k := range 3 {
		cs[0].send(cmdWrite, 0, uint64(k), uint64(k*size), size, pattern(size, byte(k)))
	}
	held := dev.wait(t, 2)
	select {
	case r := <-dev.got:
		t.Fatalf("a third %d-byte request (offset %d) got past a budget of two", size, r.Offset)
	case <-time.After(200 * time.Millisecond):
	}
	if got := sh.InFlight(); got != 2*size {
		t.Fatalf("in flight %d bytes, want %d", got, 2*size)
	}
	// Over the budget, but the second connection has nothing in flight.
	cs[1].send(cmdWrite, 0, 9, 0, size, pattern(size, 9))
	held = append(held, dev.wait(t, 1)[2])
	if got := sh.InFlight(); got != 3*size {
		t.Fatalf("in flight %d bytes, want %d", got, 3*size)
	}
	for _, r := range held {
		dev.finish(r, nil)
	}
	dev.finish(dev.wait(t, 1)[0], nil) // the third of the first connection
	for _, c := range []*tclient{cs[0], cs[0], cs[0], cs[1]} {
		if r := c.recv(0); r.errno != 0 {
			t.Fatalf("write %d: errno %d", r.cookie, r.errno)
		}
	}
	// Budget goes back once a reply is sent, just after the client can
	// read it.
	for end := time.Now().Add(5 * time.Second); sh.InFlight() != 0 && time.Now().Before(end); {
		time.Sleep(time.Millisecond)
	}
	if got := sh.InFlight(); got != 0 {
		t.Fatalf("in flight %d bytes after every reply, want 0", got)
	}
}

// TestSharedBudgetOwnDrained: a connection waiting for budget that
// others hold (a stuck backend's requests, say) goes on as soon as its
// own requests are answered, instead of waiting for theirs.
func TestSharedBudgetOwnDrained(t *testing.T) {
	const size = 32 << 10
	sh := NewShared(size)
	dev := newAsync(1 << 20)
	cs := make([]*tclient, 2)
	for i := range cs {
		s := NewServer(Config{Shared: sh})
		s.AddExport(Export{Backend: dev})
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			s.Shutdown(ctx)
		})
		a, b := socketpair(t)
		go s.ServeNegotiated(a, "")
		cs[i] = &tclient{t: t, c: b, br: bufio.NewReader(b)}
		t.Cleanup(func() { b.Close() })
		b.SetDeadline(time.Now().Add(30 * time.Second))
	}
	cs[1].send(cmdWrite, 0, 1, 0, size, pattern(size, 1)) // held for good
	stuck := dev.wait(t, 1)[0]
	cs[0].send(cmdWrite, 0, 2, size, size, pattern(size, 2))
	first := dev.wait(t, 1)[1]
	cs[0].send(cmdWrite, 0, 3, 2*size, size, pattern(size, 3)) // over the budget: waits
	select {
	case r := <-dev.got:
		t.Fatalf("a request at offset %d got past a full budget while the connection had one in flight", r.Offset)
	case <-time.After(200 * time.Millisecond):
	}
	dev.finish(first, nil)
	cs[0].recv(0)
	select {
	case r := <-dev.got:
		dev.finish(r, nil)
		cs[0].recv(0)
	case <-time.After(5 * time.Second):
		t.Fatal("the connection's own requests are answered, yet it still waits for another connection's budget")
	}
	dev.finish(stuck, nil)
	cs[1].recv(0)
}

// TestSlowRequestLogged: a request the backend sits on is logged once
// as slow, saying it waits in the backend, and again when answered.
func TestSlowRequestLogged(t *testing.T) {
	var logs syncBuffer
	sh := NewShared(0)
	sh.dog.every = 20 * time.Millisecond
	dev := newAsync(1 << 20)
	s := NewServer(Config{Shared: sh, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	s.AddExport(Export{Backend: dev})
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		s.Shutdown(ctx) // a failed test may leave the write held
	})
	a, b := socketpair(t)
	go s.ServeNegotiated(a, "")
	c := &tclient{t: t, c: b, br: bufio.NewReader(b)}
	t.Cleanup(func() { b.Close() })
	b.SetDeadline(time.Now().Add(30 * time.Second))
	c.send(cmdWrite, 0, 1, 4096, 4096, pattern(4096, 1))
	r := dev.wait(t, 1)[0]
	time.Sleep(time.Duration(slowAfter+3) * sh.dog.every)
	got := logs.String()
	if n := strings.Count(got, `msg="nbd: slow request"`); n != 1 || !strings.Contains(got, `where="in the backend"`) ||
		!strings.Contains(got, "offset=4096") {
		t.Fatalf("want one slow-request line for the write in the backend, got %d:\n%s", n, got)
	}
	dev.finish(r, nil)
	c.recv(0)
	for end := time.Now().Add(5 * time.Second); !strings.Contains(logs.String(), "slow request answered") && time.Now().Before(end); {
		time.Sleep(time.Millisecond)
	}
	if got := logs.String(); !strings.Contains(got, `msg="nbd: slow request answered" op=write offset=4096`) {
		t.Fatalf("no answered line:\n%s", got)
	}
}

// Replies the client never reads (the kernel's receive work for a
// socket not running) are reported, once, even while it goes on sending
// requests on that socket, as the kernel does; replies it reads are not.
func TestUnreadReplyLogged(t *testing.T) {
	var logs syncBuffer
	sh := NewShared(0)
	sh.dog.every = 20 * time.Millisecond
	s := NewServer(Config{Shared: sh, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	s.AddExport(Export{Backend: Inline(newFlat(1 << 20))})
	t.Cleanup(func() { s.Shutdown(context.Background()) })
	busy, quiet := &tclient{t: t}, &tclient{t: t}
	for _, c := range []*tclient{busy, quiet} {
		a, b := socketpair(t)
		go s.ServeNegotiated(a, "")
		c.c, c.br = b, bufio.NewReader(b)
		t.Cleanup(func() { b.Close() })
		b.SetDeadline(time.Now().Add(30 * time.Second))
	}
	const line = `msg="nbd: peer has not read our replies"`
	sent := 0
	step := func(i int) {
		quiet.send(cmdRead, 0, uint64(i), 0, 512, nil) // replies not read, for now
		sent++
		busy.send(cmdRead, 0, uint64(i), 0, 4096, nil)
		busy.recv(4096)
		time.Sleep(sh.dog.every / 2)
	}
	// Until the line comes (slowAfter ticks; a loaded box's ticks lag),
	// then as long again: it must come once.
	i := 0
	for deadline := time.Now().Add(10 * time.Second); !strings.Contains(logs.String(), line) && time.Now().Before(deadline); i++ {
		step(i)
	}
	for range 2 * (slowAfter + 3) {
		step(i)
		i++
	}
	if n := strings.Count(logs.String(), line); n != 1 {
		t.Fatalf("want one unread-reply line (the quiet connection's), got %d:\n%s", n, logs.String())
	}
	for range sent {
		quiet.recv(512)
	}
}

// A request the client sent that the server never reads (here: its
// reader is stuck in a Submit that does not return) is reported, once:
// the kernel would time it out with nothing in flight on our side, so
// the slow-request lines alone would say nothing.
func TestUnreadRequestLogged(t *testing.T) {
	var logs syncBuffer
	sh := NewShared(0)
	sh.dog.every = 20 * time.Millisecond
	dev := newAsync(1 << 20)
	dev.got = make(chan *Request) // Submit blocks the reader until taken
	s := NewServer(Config{Shared: sh, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	s.AddExport(Export{Backend: dev})
	a, b := socketpair(t)
	go s.ServeNegotiated(a, "")
	c := &tclient{t: t, c: b, br: bufio.NewReader(b)}
	t.Cleanup(func() { b.Close() })
	b.SetDeadline(time.Now().Add(30 * time.Second))
	c.send(cmdRead, 0, 1, 0, 4096, nil)
	time.Sleep(50 * time.Millisecond) // read, and stuck in Submit
	c.send(cmdRead, 0, 2, 4096, 4096, nil)
	time.Sleep(time.Duration(slowAfter+3) * sh.dog.every)
	got := logs.String()
	if n := strings.Count(got, `msg="nbd: socket holds a request not read"`); n != 1 || !strings.Contains(got, "unread_bytes=28") {
		t.Fatalf("want one unread-request line (28 bytes), got %d:\n%s", n, got)
	}
	for range 2 {
		dev.finish(<-dev.got, nil)
	}
	c.recv(4096)
	c.recv(4096)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := s.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
}

type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
