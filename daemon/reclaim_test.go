package daemon

import (
	"context"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestGiveBackAfterUnmapBurst: memory is released once devices went away
// and the count held still, not while it keeps dropping, and not when
// devices are only added.
func TestGiveBackAfterUnmapBurst(t *testing.T) {
	var n atomic.Int64
	n.Store(4)
	released := make(chan int64, 10)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go giveBack(ctx, 20*time.Millisecond, func() int { return int(n.Load()) }, func() { released <- n.Load() })
	expectNone := func(what string) {
		t.Helper()
		select {
		case v := <-released:
			t.Fatalf("%s: released at %d devices", what, v)
		case <-time.After(100 * time.Millisecond):
		}
	}
	n.Store(6)
	expectNone("devices added")
	n.Store(0)
	select {
	case v := <-released:
		if v != 0 {
			t.Fatalf("released at %d devices", v)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("nothing released after the last unmap")
	}
	expectNone("nothing changed since")
}

// TestEndIdleThreads: threads a burst of blocking calls left idle are
// ended, down to what is kept.
func TestEndIdleThreads(t *testing.T) {
	if goThreads() == 0 {
		t.Skip("no /proc/self/task")
	}
	// A burst: 32 goroutines in blocking syscalls at once, a thread each.
	var wg sync.WaitGroup
	for range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var ts unix.Timespec
			ts.Nsec = 50e6
			unix.Nanosleep(&ts, nil)
		}()
	}
	wg.Wait()
	before := goThreads()
	if before < 24 {
		t.Fatalf("the burst left only %d threads: the test measures nothing", before)
	}
	keep := runtime.GOMAXPROCS(0) + spareThreads
	endIdleThreads(keep)
	time.Sleep(50 * time.Millisecond) // exiting threads leave /proc shortly after
	after := goThreads()
	t.Logf("Go threads: %d after the burst, %d after endIdleThreads(%d)", before, after, keep)
	if after > keep+2 {
		t.Fatalf("%d Go threads left, want at most %d", after, keep+2)
	}
}
