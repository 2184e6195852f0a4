package rbdio

import (
	"sync"
	"testing"
	"time"
)

// TestLingerReusesTheConnection: with a linger, calls one after another
// share one connection, which shuts down once nobody took it back for
// the linger, or at its first release past its maximum age; without a
// linger, each call connects and shuts down.
func TestLingerReusesTheConnection(t *testing.T) {
	needCluster(t)
	var mu sync.Mutex
	opened, closed := 0, 0
	hooks := SessionHooks{
		Opened: func(Session) <-chan struct{} { mu.Lock(); opened++; mu.Unlock(); return nil },
		Closed: func(Session) { mu.Lock(); closed++; mu.Unlock() },
	}
	counts := func() (int, int) { mu.Lock(); defer mu.Unlock(); return opened, closed }
	pings := func(c *Clusters, n int) time.Duration {
		t.Helper()
		t0 := time.Now()
		for range n {
			if err := c.Ping(opts()); err != nil {
				t.Fatal(err)
			}
		}
		return time.Since(t0) / time.Duration(n)
	}

	cold := NewClustersWith(hooks)
	perCold := pings(cold, 3)
	if o, c := counts(); o != 3 || c != 3 || len(cold.Connections()) != 0 {
		t.Fatalf("without a linger: %d connects, %d shutdowns, %d open; want 3, 3, 0", o, c, len(cold.Connections()))
	}

	opened, closed = 0, 0
	// Long enough that a loaded box's sleeps do not overrun it.
	const linger = 2 * time.Second
	warm := NewClustersWith(hooks)
	warm.linger, warm.maxAge = linger, time.Hour
	pings(warm, 1)
	perWarm := pings(warm, 3)
	if o, c := counts(); o != 1 || c != 0 || len(warm.Connections()) != 1 {
		t.Fatalf("with a linger: %d connects, %d shutdowns, %d open; want 1, 0, 1", o, c, len(warm.Connections()))
	}
	t.Logf("a call: %s connecting each time, %s on a lingering connection", perCold, perWarm)
	// Taken back before the linger ran out: the timer starts again at
	// the next release.
	time.Sleep(linger / 2)
	pings(warm, 1)
	time.Sleep(linger / 2)
	if o, c := counts(); o != 1 || c != 0 {
		t.Fatalf("taken back within the linger: %d connects, %d shutdowns; want 1, 0", o, c)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, c := counts(); c == 1 && len(warm.Connections()) == 0 {
			break
		}
		if time.Now().After(deadline) {
			o, c := counts()
			t.Fatalf("after the linger: %d connects, %d shutdowns, %d open; want 1, 1, 0", o, c, len(warm.Connections()))
		}
		time.Sleep(20 * time.Millisecond)
	}
	// A call after that connects again.
	pings(warm, 1)
	if o, _ := counts(); o != 2 {
		t.Fatalf("a call after the linger: %d connects, want 2", o)
	}

	// Past its maximum age a connection is not kept, however busy.
	opened, closed = 0, 0
	old := NewClustersWith(hooks)
	old.linger, old.maxAge = time.Hour, 200*time.Millisecond
	pings(old, 2)
	time.Sleep(300 * time.Millisecond)
	pings(old, 1)
	if o, c := counts(); o != 1 || c != 1 || len(old.Connections()) != 0 {
		t.Fatalf("past its maximum age: %d connects, %d shutdowns, %d open; want 1, 1, 0", o, c, len(old.Connections()))
	}
}
