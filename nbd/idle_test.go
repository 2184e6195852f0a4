package nbd

import (
	"bufio"
	"context"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"
)

// threads counts this process's threads blocked in read(2) (syscall 0
// on amd64, first field of /proc/self/task/*/syscall): the test's
// clients use the netpoller, so these are the server's readers.
func threads(t *testing.T) int {
	t.Helper()
	if runtime.GOARCH != "amd64" {
		t.Skip("syscall numbers here are amd64's")
	}
	d, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Skip("no /proc/self/task")
	}
	n := 0
	for _, e := range d {
		b, err := os.ReadFile("/proc/self/task/" + e.Name() + "/syscall")
		if err == nil && strings.HasPrefix(string(b), "0 ") {
			n++
		}
	}
	return n
}

// procThreads is this process's thread count.
func procThreads(t *testing.T) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Skip("no /proc/self/status")
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "Threads:"); ok {
			n, _ := strconv.Atoi(strings.TrimSpace(v))
			return n
		}
	}
	t.Skip("no Threads in /proc/self/status")
	return 0
}

// inUse is the Go memory in use (heap objects and goroutine stacks)
// after a collection.
func inUse() int64 {
	runtime.GC()
	runtime.GC() // the second empties sync.Pools' victim caches
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapAlloc + m.StackInuse)
}

// idleConns serves n kernel-style connections (ServeNegotiated), has
// each answer one request, lets them all idle past IdleAfter, and
// returns the clients and how many more threads are then blocked in
// read(2) than before.
func idleConns(t *testing.T, idleAfter time.Duration, n int) (*Server, []*tclient, int) {
	s, cs, blocked, _, _ := idleConnsCost(t, idleAfter, n)
	return s, cs, blocked
}

// idleConnsCost is idleConns that also returns how many more threads
// the process has and how much more Go memory is in use, per connection.
func idleConnsCost(t *testing.T, idleAfter time.Duration, n int) (*Server, []*tclient, int, int, int64) {
	dev := newFlat(1 << 20)
	s := NewServer(Config{IdleAfter: idleAfter})
	s.AddExport(Export{Backend: Inline(dev)})
	t.Cleanup(func() { s.Shutdown(context.Background()) })
	before, threadsBefore, memBefore := threads(t), procThreads(t), inUse()
	cs := make([]*tclient, n)
	for i := range cs {
		a, b := socketpair(t)
		go s.ServeNegotiated(a, "")
		cs[i] = &tclient{t: t, c: b, br: bufio.NewReader(b)}
		t.Cleanup(func() { b.Close() })
		b.SetDeadline(time.Now().Add(30 * time.Second))
		cs[i].send(cmdWrite, 0, 1, 0, 4096, pattern(4096, byte(i)))
		if r := cs[i].recv(0); r.errno != 0 {
			t.Fatalf("conn %d: write errno %d", i, r.errno)
		}
	}
	// Every reader is now blocked in read(2), holding a thread, until
	// IdleAfter passes and it parks.
	time.Sleep(max(idleAfter, 0) + 300*time.Millisecond)
	return s, cs, threads(t) - before, procThreads(t) - threadsBefore, (inUse() - memBefore) / int64(n)
}

// TestIdleConnectionsGiveThreadsBack: 64 idle connections hold no
// threads with IdleAfter (their readers park in the watcher and their
// threads end) and no read buffers, where without it each holds a thread
// blocked in read and its buffer; either way every connection still
// answers at once when it gets busy again.
func TestIdleConnectionsGiveThreadsBack(t *testing.T) {
	const n = 64
	// The control first (its readers stay blocked throughout): readers
	// that never time out keep a thread and a buffer each.
	_, _, kept, grew, mem := idleConnsCost(t, -1, n)
	t.Logf("IdleAfter off: %d connections idle: %d more threads blocked in read, %d more threads, %d bytes each",
		n, kept, grew, mem)
	// Not grew: with -count > 1 the runtime reuses the threads an
	// earlier run's readers left idle.
	if kept < n/2 || mem < readBufSize {
		t.Fatalf("without IdleAfter %d connections held only %d threads blocked in read, %d threads, %d bytes each: the test measures nothing",
			n, kept, grew, mem)
	}
	_, cs, extra, grew, mem := idleConnsCost(t, 50*time.Millisecond, n)
	t.Logf("IdleAfter 50ms: %d connections idle: %d more threads blocked in read, %d more threads, %d bytes each",
		n, extra, grew, mem)
	if extra > n/8 || grew > n/8 {
		t.Errorf("%d idle connections kept %d threads blocked in read, %d threads in all", n, extra, grew)
	}
	if mem > 32<<10 {
		t.Errorf("an idle connection costs %d bytes of Go memory, want at most 32 KiB", mem)
	}
	for i, c := range cs {
		c.send(cmdRead, 0, 2, 0, 4096, nil)
		if r := c.recv(4096); r.errno != 0 {
			t.Fatalf("conn %d after idling: errno %d", i, r.errno)
		}
	}
}

// TestShutdownWakesIdleReader: a parked reader is woken by Shutdown's
// shutdown(2), like a blocked one.
func TestShutdownWakesIdleReader(t *testing.T) {
	s, _, _ := idleConns(t, 20*time.Millisecond, 4)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := s.Shutdown(ctx); err != nil {
		t.Fatalf("Shutdown with idle readers: %v", err)
	}
}

// TestIdleReaderKeepsPartialRequest: a request that arrives in pieces
// with an idle pause in the middle of its payload is still read whole.
func TestIdleReaderKeepsPartialRequest(t *testing.T) {
	dev := newFlat(1 << 20)
	s := NewServer(Config{IdleAfter: 20 * time.Millisecond})
	s.AddExport(Export{Backend: Inline(dev)})
	t.Cleanup(func() { s.Shutdown(context.Background()) })
	a, b := socketpair(t)
	go s.ServeNegotiated(a, "")
	c := &tclient{t: t, c: b, br: bufio.NewReader(b)}
	t.Cleanup(func() { b.Close() })
	b.SetDeadline(time.Now().Add(30 * time.Second))
	req := reqBytes(cmdWrite, 0, 7, 8192, 4096, pattern(4096, 9))
	c.write(req[:10])
	time.Sleep(100 * time.Millisecond)
	c.write(req[10:2000])
	time.Sleep(100 * time.Millisecond)
	c.write(req[2000:])
	if r := c.recv(0); r.cookie != 7 || r.errno != 0 {
		t.Fatalf("reply %+v", r)
	}
	got, _, _ := dev.state()
	if string(got[8192:8192+4096]) != string(pattern(4096, 9)) {
		t.Fatal("payload written wrong after idle pauses")
	}
}

// BenchmarkIdleWakeup: the latency of the first request after a pause,
// with the reader parked in the idle watcher (IdleAfter 5 ms, pause 10
// ms) against a reader that stayed blocked in read(2). Only the
// request's round trip is timed, not the pause.
func BenchmarkIdleWakeup(b *testing.B) {
	for _, bc := range []struct {
		name string
		idle time.Duration
	}{{"parked", 5 * time.Millisecond}, {"blocked", -1}} {
		b.Run(bc.name, func(b *testing.B) {
			s := NewServer(Config{IdleAfter: bc.idle})
			s.AddExport(Export{Backend: Inline(newFlat(1 << 20))})
			b.Cleanup(func() { s.Shutdown(context.Background()) })
			a, cl := socketpair(b)
			go s.ServeNegotiated(a, "")
			c := &tclient{t: b, c: cl, br: bufio.NewReader(cl)}
			b.Cleanup(func() { cl.Close() })
			var total time.Duration
			for i := 0; b.Loop(); i++ {
				b.StopTimer()
				time.Sleep(10 * time.Millisecond)
				b.StartTimer()
				t0 := time.Now()
				c.send(cmdRead, 0, uint64(i), 0, 4096, nil)
				c.recv(4096)
				total += time.Since(t0)
			}
			b.ReportMetric(float64(total.Microseconds())/float64(b.N), "wake-µs")
		})
	}
}
