package daemon

import (
	"context"
	"sync/atomic"
	"testing"
	"time"
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
