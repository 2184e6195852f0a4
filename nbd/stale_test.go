package nbd

import (
	"bufio"
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"
)

// staleRig: one export on an async backend, served on two connections
// as the kernel's are, with a fast watchdog.
func staleRig(t *testing.T, staleAfter time.Duration) (*asyncFake, [2]*tclient, *syncBuffer, *Shared) {
	dev, cs, logs, sh := staleRigN(t, staleAfter, 2)
	return dev, [2]*tclient{cs[0], cs[1]}, logs, sh
}

// staleRigN is staleRig with n connections.
func staleRigN(t *testing.T, staleAfter time.Duration, n int) (*asyncFake, []*tclient, *syncBuffer, *Shared) {
	var logs syncBuffer
	sh := NewShared(0)
	sh.dog.every = 10 * time.Millisecond
	dev := newAsync(4 << 20)
	s := NewServer(Config{Shared: sh, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	s.AddExport(Export{Backend: dev, StaleAfter: staleAfter})
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		s.Shutdown(ctx)
	})
	cs := make([]*tclient, n)
	for i := range cs {
		a, b := socketpair(t)
		go s.ServeNegotiated(a, "")
		cs[i] = &tclient{t: t, c: b, br: bufio.NewReader(b)}
		b.SetDeadline(time.Now().Add(30 * time.Second))
		t.Cleanup(func() { b.Close() })
	}
	return dev, cs, &logs, sh
}

// submitted waits for the next request to reach the backend.
func submitted(t *testing.T, dev *asyncFake, why string) *Request {
	t.Helper()
	select {
	case r := <-dev.got:
		return r
	case <-time.After(5 * time.Second):
		t.Fatal(why)
		return nil
	}
}

func noSubmit(t *testing.T, dev *asyncFake, within time.Duration) {
	t.Helper()
	select {
	case r := <-dev.got:
		t.Fatalf("%v at %d reached the backend while an overlapping stale write was in it", r.Op, r.Offset)
	case <-time.After(within):
	}
}

// TestRetryWaitsForStaleWrite plays the kernel's retry: a write stuck in
// the backend past the slow mark is sent again on the other connection.
// The copy must not reach the backend before the original has left it;
// a write elsewhere must.
func TestRetryWaitsForStaleWrite(t *testing.T) {
	dev, cs, logs, sh := staleRig(t, 0)
	cs[0].send(cmdWrite, 0, 1, 8192, 4096, pattern(4096, 1))
	orig := dev.wait(t, 1)[0]
	time.Sleep(time.Duration(slowAfter+3) * sh.dog.every)

	cs[1].send(cmdWrite, 0, 2, 1<<20, 4096, pattern(4096, 2)) // elsewhere: not held
	other := submitted(t, dev, "a write elsewhere was held")
	if other.Offset != 1<<20 {
		t.Fatalf("got %d", other.Offset)
	}
	cs[1].send(cmdWrite, 0, 3, 4096, 8192, pattern(8192, 3)) // overlaps [8192, 12288)
	noSubmit(t, dev, 200*time.Millisecond)

	dev.finish(orig, nil)
	cs[0].recv(0)
	r := submitted(t, dev, "the retried write was never submitted after the original completed")
	if r.Offset != 4096 {
		t.Fatalf("released %d", r.Offset)
	}
	dev.finish(r, nil)
	dev.finish(other, nil)
	cs[1].recv(0)
	cs[1].recv(0)
	if !strings.Contains(logs.String(), "held a write until an overlapping one") {
		t.Fatalf("no log line:\n%s", logs.String())
	}
}

// TestYoungOverlapNotHeld: overlapping writes in flight for less than
// the slow mark are the client's business and go straight through.
func TestYoungOverlapNotHeld(t *testing.T) {
	dev, cs, _, _ := staleRig(t, 0)
	cs[0].send(cmdWrite, 0, 1, 0, 4096, pattern(4096, 1))
	a := <-dev.got
	cs[1].send(cmdWrite, 0, 2, 0, 4096, pattern(4096, 2))
	dev.finish(submitted(t, dev, "a young overlapping write was held"), nil)
	dev.finish(a, nil)
	cs[0].recv(0)
	cs[1].recv(0)
}

// TestStaleReadNotHeld: reads are never held, and a stale read holds no
// write.
func TestStaleReadNotHeld(t *testing.T) {
	dev, cs, _, sh := staleRig(t, 0)
	cs[0].send(cmdRead, 0, 1, 0, 4096, nil)
	rd := <-dev.got
	time.Sleep(time.Duration(slowAfter+3) * sh.dog.every)
	cs[1].send(cmdWrite, 0, 2, 0, 4096, pattern(4096, 2))
	dev.finish(submitted(t, dev, "a write behind a stale read was held"), nil)
	dev.finish(rd, nil)
	cs[0].recv(4096)
	cs[1].recv(0)
}

// TestStaleAfterFollowsTheExport: a device mapped with a short kernel
// timeout has its writes marked stale sooner, before the kernel's retry.
func TestStaleAfterFollowsTheExport(t *testing.T) {
	dev, cs, _, sh := staleRig(t, 20*time.Millisecond) // two ticks
	cs[0].send(cmdWrite, 0, 1, 0, 4096, pattern(4096, 1))
	orig := <-dev.got
	time.Sleep(4 * sh.dog.every) // under the default mark of five ticks
	cs[1].send(cmdWrite, 0, 2, 0, 4096, pattern(4096, 2))
	noSubmit(t, dev, 100*time.Millisecond)
	dev.finish(orig, nil)
	dev.finish(<-dev.got, nil)
	cs[0].recv(0)
	cs[1].recv(0)
}

// TestRetriedTwiceNotDeadlocked: two writes over the range of one sat in
// the backend (an OSD cut off) are held, each past the stale mark. Their
// payloads differ from the first's, so neither is answered from it (see
// TestRetryAnsweredByItsFirstCopy for repeats). They must not wait for
// each other: once the first completes, both go through. A write
// released past the mark is marked at once, so a newer overlapping write
// waits for it.
func TestRetriedTwiceNotDeadlocked(t *testing.T) {
	dev, cs, _, sh := staleRigN(t, 0, 3)
	mark := time.Duration(slowAfter+3) * sh.dog.every
	cs[0].send(cmdWrite, 0, 1, 8192, 4096, pattern(4096, 1))
	orig := dev.wait(t, 1)[0]
	time.Sleep(mark)
	cs[1].send(cmdWrite, 0, 2, 8192, 4096, pattern(4096, 5))
	time.Sleep(mark)
	cs[2].send(cmdWrite, 0, 3, 8192, 4096, pattern(4096, 6))
	noSubmit(t, dev, mark)
	dev.finish(orig, nil)
	cs[0].recv(0)
	a := submitted(t, dev, "held copies of one write waited for each other")
	var b *Request
	select {
	case b = <-dev.got:
	case <-time.After(time.Second):
		// One copy may wait for the other, now in the backend and
		// marked: that one must then finish first.
		dev.finish(a, nil)
		b, a = submitted(t, dev, "the last copy was never submitted"), nil
	}
	// A newer write over the range waits for whatever copy is still in.
	cs[0].send(cmdWrite, 0, 4, 8192, 4096, pattern(4096, 2))
	noSubmit(t, dev, 100*time.Millisecond)
	if a != nil {
		dev.finish(a, nil)
	}
	dev.finish(b, nil)
	cs[1].recv(0)
	cs[2].recv(0)
	dev.finish(submitted(t, dev, "the newer write was never submitted"), nil)
	cs[0].recv(0)
}

// TestRetryAnsweredByItsFirstCopy: the kernel's retries of a write still
// in the backend (the same range, flags and bytes; the handle's tag may
// change) are held, then answered with the first copy's success without
// reaching the backend again. A first copy that failed has its retry
// executed; and a write of other bytes over the same range is executed
// after the first copy, as before.
func TestRetryAnsweredByItsFirstCopy(t *testing.T) {
	dev, cs, logs, sh := staleRigN(t, 0, 3)
	mark := time.Duration(slowAfter+3) * sh.dog.every
	const tag = 0x00010007
	cs[0].send(cmdWrite, 0, 1<<32|tag, 8192, 4096, pattern(4096, 1))
	orig := dev.wait(t, 1)[0]
	time.Sleep(mark)
	cs[1].send(cmdWrite, 0, 2<<32|tag, 8192, 4096, pattern(4096, 1)) // its retry
	time.Sleep(mark)
	cs[2].send(cmdWrite, 0, 3<<32|0x00010009, 8192, 4096, pattern(4096, 1)) // again, under another tag
	noSubmit(t, dev, mark)
	dev.finish(orig, nil)
	cs[0].recv(0)
	if r := cs[1].recv(0); r.errno != 0 || r.cookie != 2<<32|tag {
		t.Fatalf("the retry's reply: %+v", r)
	}
	if r := cs[2].recv(0); r.errno != 0 || r.cookie != 3<<32|0x00010009 {
		t.Fatalf("the second retry's reply: %+v", r)
	}
	noSubmit(t, dev, 100*time.Millisecond)
	if !strings.Contains(logs.String(), "answered a kernel retry with its first copy's result") {
		t.Fatalf("no log line:\n%s", logs.String())
	}

	// The first copy fails: the retry is the real attempt.
	cs[0].send(cmdWrite, 0, 3<<32|tag, 16384, 4096, pattern(4096, 2))
	orig = dev.wait(t, 1)[0]
	time.Sleep(mark)
	cs[1].send(cmdWrite, 0, 4<<32|tag, 16384, 4096, pattern(4096, 2))
	noSubmit(t, dev, mark)
	dev.finish(orig, ErrIO)
	if r := cs[0].recv(0); r.errno == 0 {
		t.Fatal("the failed first copy was answered without an error")
	}
	retry := submitted(t, dev, "the retry of a failed write was never executed")
	dev.finish(retry, nil)
	if r := cs[1].recv(0); r.errno != 0 {
		t.Fatalf("the executed retry: %+v", r)
	}

	// Other bytes over the same range: no repeat.
	cs[0].send(cmdWrite, 0, 5<<32|tag, 32768, 4096, pattern(4096, 3))
	orig = dev.wait(t, 1)[0]
	time.Sleep(mark)
	cs[2].send(cmdWrite, 0, 6<<32|(tag+1), 32768, 4096, pattern(4096, 4))
	noSubmit(t, dev, mark)
	dev.finish(orig, nil)
	cs[0].recv(0)
	dev.finish(submitted(t, dev, "a write of other bytes over a stale one's range was answered without executing it"), nil)
	cs[2].recv(0)
}

// TestRepeatAfterAnOverlapIsWritten: a write repeating a stale one is not
// answered from it when another write over the range was answered in
// between (sent before the first was stale, so not held): the repeat must
// land after that one, and the first copy may not have.
func TestRepeatAfterAnOverlapIsWritten(t *testing.T) {
	dev, cs, _, sh := staleRigN(t, 0, 3)
	mark := time.Duration(slowAfter+3) * sh.dog.every
	cs[0].send(cmdWrite, 0, 1, 8192, 4096, pattern(4096, 1))
	orig := dev.wait(t, 1)[0]
	cs[1].send(cmdWrite, 0, 2, 8192, 4096, pattern(4096, 2)) // young: not held
	dev.finish(submitted(t, dev, "a young overlapping write was held"), nil)
	cs[1].recv(0)
	time.Sleep(mark)
	cs[2].send(cmdWrite, 0, 3, 8192, 4096, pattern(4096, 1)) // the first's bytes again
	noSubmit(t, dev, mark)
	dev.finish(orig, nil)
	cs[0].recv(0)
	dev.finish(submitted(t, dev, "a repeat after an answered overlap was answered without writing it"), nil)
	cs[2].recv(0)
}
