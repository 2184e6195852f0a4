package nbd

import (
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
// The fast path pays one atomic load per write while nothing is stale.
type staleGate struct {
	after time.Duration // Export.StaleAfter
	n     atomic.Int32  // len(reqs), for the lock-free check
	mu    sync.Mutex
	reqs  []staleReq
}

type staleReq struct {
	c        *conn
	r        *Request
	born     uint32 // r.born when marked: a reused request is another one
	off, end uint64
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
	g.reqs = append(g.reqs, staleReq{c: c, r: r, born: r.born, off: r.Offset, end: r.Offset + uint64(r.Length)})
	g.n.Store(int32(len(g.reqs)))
	g.mu.Unlock()
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
	reqs := append([]staleReq(nil), g.reqs...)
	g.mu.Unlock()
	var done []staleReq
	for i := range reqs {
		if reqs[i].gone() {
			done = append(done, reqs[i])
		}
	}
	if len(done) == 0 {
		return
	}
	g.mu.Lock()
	g.reqs = slices.DeleteFunc(g.reqs, func(s staleReq) bool {
		return slices.ContainsFunc(done, func(d staleReq) bool { return d.r == s.r && d.born == s.born })
	})
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
