package nbd

import (
	"sync/atomic"
	"time"
)

// Stats counts one export's requests for metrics and iostat: per
// command, requests, bytes and two latencies (time queued in this
// server before the backend had the request, and time in the backend),
// plus errors by errno, requests in the backend, and READ data lent or
// spliced. Set Export.Stats to turn it on. Every update is an atomic add
// on memory the export owns: the request path never allocates or locks
// for it, and readers (a scrape, iostat) take a Snapshot at any time.
type Stats struct {
	epoch    time.Time // monotonic base of the request timestamps
	ops      [numCmds]opStats
	errs     [len(statErrnos)]atomic.Uint64
	inflight atomic.Int64
	conns    atomic.Int64  // connections being served
	closed   atomic.Uint64 // connections that ended
	loans    atomic.Uint64
	spliced  atomic.Uint64
}

// NewStats returns zeroed counters.
func NewStats() *Stats { return &Stats{epoch: time.Now()} }

// numCmds covers the NBD commands, indexed by their number (DISC and
// unknown ones never count).
const numCmds = 8

type opStats struct {
	reqs, bytes     atomic.Uint64
	queued, backend histogram
}

// LatencyBounds are the histograms' bucket upper bounds: 50 µs (a
// request served from memory) to 30 s (the kernel's default timeout).
var LatencyBounds = [...]time.Duration{
	50 * time.Microsecond, 100 * time.Microsecond, 250 * time.Microsecond, 500 * time.Microsecond,
	time.Millisecond, 2500 * time.Microsecond, 5 * time.Millisecond, 10 * time.Millisecond,
	25 * time.Millisecond, 50 * time.Millisecond, 100 * time.Millisecond, 250 * time.Millisecond,
	500 * time.Millisecond, time.Second, 2500 * time.Millisecond, 5 * time.Second, 10 * time.Second,
	30 * time.Second,
}

// histogram counts observations per bucket (not cumulative; the last
// is +Inf) and their sum.
type histogram struct {
	buckets [len(LatencyBounds) + 1]atomic.Uint64
	sum     atomic.Int64 // nanoseconds
}

func (h *histogram) observe(d time.Duration) {
	i := 0
	for i < len(LatencyBounds) && d > LatencyBounds[i] {
		i++
	}
	h.buckets[i].Add(1)
	h.sum.Add(int64(d))
}

// statErrnos are the errors counted, in Snapshot.Errors order.
var statErrnos = [...]Errno{ErrPerm, ErrIO, ErrNoMem, ErrInvalid, ErrNoSpace, ErrOverflow, ErrNotSupported, ErrShutdown}

// statErrnoNames are statErrnos' names, as errno(3) spells them.
var statErrnoNames = [...]string{"EPERM", "EIO", "ENOMEM", "EINVAL", "ENOSPC", "EOVERFLOW", "ENOTSUP", "ESHUTDOWN"}

// now is the time since the epoch, on the monotonic clock.
func (s *Stats) now() int64 { return int64(time.Since(s.epoch)) }

// submitted counts r into the backend.
func (s *Stats) submitted(r *Request) {
	r.tSubmit = s.now()
	s.inflight.Add(1)
}

// done counts r, answered with err.
func (s *Stats) done(r *Request) {
	if int(r.cmd) >= numCmds {
		return
	}
	t := s.now()
	o := &s.ops[r.cmd]
	o.reqs.Add(1)
	o.bytes.Add(uint64(r.Length))
	if r.tSubmit > 0 {
		s.inflight.Add(-1)
		o.queued.observe(time.Duration(r.tSubmit - r.tRead))
		o.backend.observe(time.Duration(t - r.tSubmit))
	} else {
		o.queued.observe(time.Duration(t - r.tRead))
	}
	if r.loan != nil {
		s.loans.Add(1)
	}
	if r.err != nil {
		e := ErrnoOf(r.err)
		for i, x := range statErrnos {
			if x == e {
				s.errs[i].Add(1)
				break
			}
		}
	}
}

// Snapshot is Stats at one moment.
type Snapshot struct {
	// Ops by command name (Op.String: "read", "write", "flush", "trim",
	// "cache", "write-zeroes", "block-status"); commands never seen are
	// left out.
	Ops map[string]OpSnapshot
	// Errors by errno name (EIO, ...), those seen only.
	Errors map[string]uint64
	// InFlight is the requests in the backend now.
	InFlight int64
	// Conns is the connections being served now; Closed counts those
	// that ended (the kernel gave up on a socket, a reconfigure, a
	// handover, a client disconnecting).
	Conns  int64
	Closed uint64
	// Loans counts READs answered with data the backend lent; Spliced
	// the bytes of those sent by reference (zero-copy).
	Loans, Spliced uint64
}

// OpSnapshot is one command's counts.
type OpSnapshot struct {
	Requests, Bytes uint64
	Queued, Backend HistogramSnapshot
}

// HistogramSnapshot holds per-bucket counts (Counts[i] for durations up
// to LatencyBounds[i], the last beyond them all) and their sum.
type HistogramSnapshot struct {
	Counts [len(LatencyBounds) + 1]uint64
	Sum    time.Duration
}

func (h *histogram) snapshot() HistogramSnapshot {
	var out HistogramSnapshot
	for i := range h.buckets {
		out.Counts[i] = h.buckets[i].Load()
	}
	out.Sum = time.Duration(h.sum.Load())
	return out
}

// Count is the observations in h.
func (h HistogramSnapshot) Count() uint64 {
	var n uint64
	for _, c := range h.Counts {
		n += c
	}
	return n
}

// Quantile estimates the q-th quantile (0..1) by linear interpolation in
// its bucket, as Prometheus's histogram_quantile does; 0 when empty.
func (h HistogramSnapshot) Quantile(q float64) time.Duration {
	n := h.Count()
	if n == 0 {
		return 0
	}
	rank := q * float64(n)
	var seen float64
	for i, c := range h.Counts {
		if seen+float64(c) < rank || c == 0 {
			seen += float64(c)
			continue
		}
		if i == len(LatencyBounds) {
			return LatencyBounds[i-1] // beyond the last bound: say the bound
		}
		lo := time.Duration(0)
		if i > 0 {
			lo = LatencyBounds[i-1]
		}
		return lo + time.Duration(float64(LatencyBounds[i]-lo)*(rank-seen)/float64(c))
	}
	return LatencyBounds[len(LatencyBounds)-1]
}

// Sub is h minus an earlier snapshot of the same histogram: what
// happened between them.
func (h HistogramSnapshot) Sub(old HistogramSnapshot) HistogramSnapshot {
	for i := range h.Counts {
		h.Counts[i] -= old.Counts[i]
	}
	h.Sum -= old.Sum
	return h
}

// Snapshot reads the counters. Each is read atomically; together they
// may be a request apart.
func (s *Stats) Snapshot() Snapshot {
	out := Snapshot{Ops: map[string]OpSnapshot{}, Errors: map[string]uint64{},
		InFlight: s.inflight.Load(), Conns: s.conns.Load(), Closed: s.closed.Load(),
		Loans: s.loans.Load(), Spliced: s.spliced.Load()}
	for cmd := range s.ops {
		o := &s.ops[cmd]
		n := o.reqs.Load()
		if n == 0 {
			continue
		}
		out.Ops[Op(cmd).String()] = OpSnapshot{Requests: n, Bytes: o.bytes.Load(),
			Queued: o.queued.snapshot(), Backend: o.backend.snapshot()}
	}
	for i := range statErrnos {
		if n := s.errs[i].Load(); n > 0 {
			out.Errors[statErrnoNames[i]] = n
		}
	}
	return out
}
