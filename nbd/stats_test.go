package nbd

import (
	"testing"
	"time"
)

// TestStatsCount: requests, bytes, both latencies, errors and in-flight,
// as a client's requests are read, held in the backend and answered.
func TestStatsCount(t *testing.T) {
	st := NewStats()
	a := newAsync(1 << 20)
	s := newTestServer(t, Export{Backend: a, Stats: st})
	c := connect(t, s)
	c.open("", false)
	for i := range 3 {
		c.send(cmdWrite, 0, uint64(i), uint64(i)*4096, 4096, make([]byte, 4096))
	}
	c.send(cmdRead, 0, 10, 0, 8192, nil)
	held := a.wait(t, 4)
	if n := st.Snapshot().InFlight; n != 4 {
		t.Fatalf("in flight %d, want 4 held in the backend", n)
	}
	time.Sleep(20 * time.Millisecond) // measurable time in the backend
	for i, r := range held {
		var err error
		if i == 1 {
			err = ErrNoSpace
		}
		a.finish(r, err)
		n := 0
		if r.Op == OpRead {
			n = 8192
		}
		c.recv(n)
	}
	// Refused before the backend: a read past the end.
	c.send(cmdRead, 0, 11, 1<<20, 4096, nil)
	if r := c.recv(0); r.errno != errInval {
		t.Fatalf("read past the end: errno %d", r.errno)
	}
	sn := st.Snapshot()
	w, r := sn.Ops["write"], sn.Ops["read"]
	if w.Requests != 3 || w.Bytes != 3*4096 || r.Requests != 2 || r.Bytes != 8192+4096 {
		t.Fatalf("write %d req %d B, read %d req %d B", w.Requests, w.Bytes, r.Requests, r.Bytes)
	}
	if sn.InFlight != 0 || sn.Conns != 1 || sn.Closed != 0 {
		t.Fatalf("in flight %d after every reply; conns %d, closed %d", sn.InFlight, sn.Conns, sn.Closed)
	}
	if sn.Errors["ENOSPC"] != 1 || sn.Errors["EINVAL"] != 1 || len(sn.Errors) != 2 {
		t.Fatalf("errors %v", sn.Errors)
	}
	// Every request has a queue time; only the three writes and the
	// first read reached the backend, each for 20 ms or more.
	if w.Queued.Count() != 3 || r.Queued.Count() != 2 || w.Backend.Count() != 3 || r.Backend.Count() != 1 {
		t.Fatalf("histogram counts: write %d/%d, read %d/%d", w.Queued.Count(), w.Backend.Count(),
			r.Queued.Count(), r.Backend.Count())
	}
	if q := w.Backend.Quantile(0.5); q < 10*time.Millisecond || w.Backend.Sum < 60*time.Millisecond {
		t.Fatalf("write backend median %s, sum %s: the 20 ms held was not seen", q, w.Backend.Sum)
	}
	if w.Queued.Sum > w.Backend.Sum {
		t.Fatalf("queued %s more than in the backend %s", w.Queued.Sum, w.Backend.Sum)
	}
}

// TestQuantile: interpolated within the bucket, as histogram_quantile.
func TestQuantile(t *testing.T) {
	var h HistogramSnapshot
	if h.Quantile(0.9) != 0 {
		t.Fatal("empty histogram has a quantile")
	}
	// 10 in (1 ms, 2.5 ms]: the median is halfway through it.
	h.Counts[5] = 10
	if q := h.Quantile(0.5); q != 1750*time.Microsecond {
		t.Fatalf("median %s, want 1.75ms", q)
	}
	h.Counts[len(h.Counts)-1] = 90
	if q := h.Quantile(0.99); q != 30*time.Second {
		t.Fatalf("p99 beyond the last bound: %s", q)
	}
	d := h.Sub(HistogramSnapshot{Counts: h.Counts})
	if d.Count() != 0 {
		t.Fatalf("sub left %d", d.Count())
	}
}
