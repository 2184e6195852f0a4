package nbd

import (
	"bytes"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// The kernel does not fail a request it times out: it marks that socket
// dead and sends the request again, on another connection of the device
// or on the socket that replaces the dead one, while the first copy may
// still sit in the backend (librbd waiting on an OSD). Were the copy to
// complete first, the filesystem could take the range as written and
// overwrite it, and then the stale first copy would land over the newer
// data. So a write-like request in the backend for as long as the
// watchdog calls slow (10 s, well under the kernel's 30 s) is marked
// stale on its export, and a write-like request overlapping it, from any
// connection, waits until the stale one has left the backend. Waiting
// is always allowed: concurrent overlapping writes have no order. A
// held request is not in the backend and is never marked while held
// (two held copies would wait for each other); released past the mark,
// it is marked before it is submitted.
//
// A held copy that repeats the stale request exactly (the same command,
// range, flags and payload bytes: the kernel's retry of it, whose handle
// may differ, as the block layer may give a requeued request another
// tag) is not submitted again: once the first copy succeeds, the copy is
// answered with that; a failed first copy is retried for real. Executed
// again, every retry would add a whole write to a backend already slower
// than the kernel's timer, and each copy would wait for the last, never
// catching up; answered from the first copy, the retry in flight when it
// completes gets its reply. An identical write that is not a retry is
// concurrent with the first, but may have to land after another write
// over the range answered meanwhile, which the backend may have let
// overtake the first: so no repeat is answered from a first copy once a
// write-like request over its range has left the backend since the first
// was read (per 4 MiB bucket and watchdog tick: coarse, so it only ever
// refuses too often).
//
// The fast path pays, while nothing is stale, one atomic load per write,
// one store per write-like completion (wrote) and two per request read
// (Request.payloadIn).
type staleGate struct {
	after time.Duration // Export.StaleAfter
	n     atomic.Int32  // len(reqs), for the lock-free check
	mu    sync.Mutex
	reqs  []*staleReq
	// left: per 4 MiB of the export (hashed), 1 + the watchdog tick at
	// which a write-like request over it last left the backend.
	left [leftBuckets]atomic.Uint32
}

const (
	leftBuckets = 1024
	leftShift   = 22 // 4 MiB
)

// wrote records that a write-like request over [off, off+length) left
// the backend at watchdog tick now: a repeat of an older stale write over
// it is no longer answered from that one (dupOf).
func (g *staleGate) wrote(off uint64, length uint32, now uint32) {
	if length == 0 {
		return
	}
	for b := off >> leftShift; b <= (off+uint64(length)-1)>>leftShift; b++ {
		g.left[b%leftBuckets].Store(now + 1)
	}
}

// wroteSince reports whether a write-like request over [off, end) left
// the backend at or after tick born.
func (g *staleGate) wroteSince(off, end uint64, born uint32) bool {
	for b := off >> leftShift; b <= (end-1)>>leftShift; b++ {
		if g.left[b%leftBuckets].Load() > born {
			return true
		}
	}
	return false
}

type staleReq struct {
	c        *conn
	r        *Request
	born     uint32 // r.born when marked: a reused request is another one
	off, end uint64
	// What a repeat of it matches (see dupOf); full: its payload was
	// whole when marked, so r.Data may be compared until done.
	cmd, cflags uint16
	full        bool
	// Set by finished, under g.mu, when it leaves the backend.
	done bool
	err  error
}

// stalePoll is how often a held write looks again; the watchdog's tick
// also clears requests that completed.
const stalePoll = 5 * time.Millisecond

// ticks is the stale mark in watchdog ticks: the slow mark (10 s, for
// the kernel's default 30 s) unless the export says. A request read
// just after a tick is marked at most one tick later than its age says.
func (g *staleGate) ticks(wd *watchdog) uint32 {
	if g.after <= 0 {
		return wd.after
	}
	return max(1, uint32(g.after/wd.every))
}

func writeLike(cmd uint16) bool { return cmd == cmdWrite || cmd == cmdTrim || cmd == cmdWriteZeroes }

// mark records c's request r, in the backend, as stale if it writes
// (c.mu held).
func (g *staleGate) mark(c *conn, r *Request) {
	if !writeLike(r.cmd) {
		return
	}
	g.mu.Lock()
	g.reqs = append(g.reqs, &staleReq{c: c, r: r, born: r.born, off: r.Offset, end: r.Offset + uint64(r.Length),
		cmd: r.cmd, cflags: r.cflags, full: r.payloadIn.Load()})
	g.n.Store(int32(len(g.reqs)))
	g.mu.Unlock()
}

// finished records that c's stale request r has left the backend with
// r.err, and forgets it (c.mu held, as for mark).
func (g *staleGate) finished(r *Request) {
	g.mu.Lock()
	g.reqs = slices.DeleteFunc(g.reqs, func(s *staleReq) bool {
		if s.r != r || s.born != r.born {
			return false
		}
		s.done, s.err = true, r.err
		return true
	})
	g.n.Store(int32(len(g.reqs)))
	g.mu.Unlock()
}

// dupOf returns the stale request r repeats exactly, if any: the same
// command, range, flags and, for a WRITE, payload bytes (r's is whole),
// with no write-like request over the range gone from the backend since
// it was read.
// The stale one's payload is read under g.mu while it is listed: its
// buffer is released only after finished, which unlists it under g.mu.
func (g *staleGate) dupOf(r *Request) *staleReq {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, s := range g.reqs {
		if s.r == r || !s.full || s.cmd != r.cmd || s.cflags != r.cflags ||
			s.off != r.Offset || s.end != r.Offset+uint64(r.Length) || g.wroteSince(s.off, s.end, s.born) {
			continue
		}
		if r.cmd != cmdWrite || bytes.Equal(s.r.Data[:r.Length], r.Data[:r.Length]) {
			return s
		}
	}
	return nil
}

// succeeded reports whether s left the backend without an error.
func (g *staleGate) succeeded(s *staleReq) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return s.done && s.err == nil
}

// gone reports whether s has left the backend (s.c.mu not held).
func (s *staleReq) gone() bool {
	s.c.mu.Lock()
	defer s.c.mu.Unlock()
	return s.r.state != reqBackend || s.r.born != s.born
}

// prune forgets the stale requests that have left the backend. Their
// connections' locks are taken without g.mu: mark holds a connection's
// lock, then g.mu.
func (g *staleGate) prune() {
	g.mu.Lock()
	reqs := append([]*staleReq(nil), g.reqs...)
	g.mu.Unlock()
	var done []*staleReq
	for _, s := range reqs {
		if s.gone() {
			done = append(done, s)
		}
	}
	if len(done) == 0 {
		return
	}
	g.mu.Lock()
	g.reqs = slices.DeleteFunc(g.reqs, func(s *staleReq) bool { return slices.Contains(done, s) })
	g.n.Store(int32(len(g.reqs)))
	g.mu.Unlock()
}

// overlaps reports whether [off, end) overlaps a stale request of
// another request than r.
func (g *staleGate) overlaps(r *Request) bool {
	off, end := r.Offset, r.Offset+uint64(r.Length)
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, s := range g.reqs {
		if s.r != r && s.off < end && off < s.end {
			return true
		}
	}
	return false
}

// wait holds r while it overlaps a stale request (r is marked gated
// meanwhile, by the caller).
func (g *staleGate) wait(r *Request) {
	for g.overlaps(r) {
		time.Sleep(stalePoll)
		g.prune()
	}
}
