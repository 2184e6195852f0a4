package nbd

import (
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// Slow requests. The kernel gives a request 30 s (its block-layer
// timeout) before it declares the connection dead; a request that takes
// that long is an outage seen from the client, and the first question
// is where it waited: in the backend (librbd, the OSDs), or completed
// but with its reply not yet sent (ours). A watchdog looks at every
// request in flight once per slowTick and logs each one that has been
// in flight for slowAfter, once, with that answer; and logs again when
// it is finally answered.
//
// Per request this costs one atomic load and two stores, all under
// locks taken anyway.
const (
	slowTick  = 2 * time.Second
	slowAfter = 5 // ticks: 10 s
)

// Request states, for the watchdog.
const (
	reqFree    uint8 = iota
	reqBackend       // read (a WRITE's payload perhaps still arriving) or submitted, not completed
	reqReply         // completed, reply not yet sent
)

// watchdog tracks the connections of a Shared while any exist.
type watchdog struct {
	every time.Duration // slowTick; tests shorten it
	after uint32        // slowAfter
	tick  atomic.Uint32 // advanced by the loop, stamped on requests
	mu    sync.Mutex
	conns map[*conn]struct{}
	alive bool
}

func (wd *watchdog) add(c *conn) {
	wd.mu.Lock()
	defer wd.mu.Unlock()
	if wd.conns == nil {
		wd.conns = map[*conn]struct{}{}
	}
	wd.conns[c] = struct{}{}
	if !wd.alive {
		wd.alive = true
		go wd.loop()
	}
}

func (wd *watchdog) remove(c *conn) {
	wd.mu.Lock()
	delete(wd.conns, c)
	wd.mu.Unlock()
}

func (wd *watchdog) loop() {
	t := time.NewTicker(wd.every)
	defer t.Stop()
	var cs []*conn
	for range t.C {
		wd.mu.Lock()
		if len(wd.conns) == 0 {
			wd.alive = false
			wd.mu.Unlock()
			return
		}
		now := wd.tick.Add(1)
		cs = cs[:0]
		for c := range wd.conns {
			c.sampleUnread() // under wd.mu: its descriptor is still open
			cs = append(cs, c)
		}
		wd.mu.Unlock()
		for _, c := range cs {
			c.reportSlow(now, wd)
		}
		clear(cs)
	}
}

// reportSlow logs this connection's requests in flight for slowAfter
// ticks, once each.
func (c *conn) reportSlow(now uint32, wd *watchdog) {
	type slow struct {
		op          Op
		off         uint64
		length      uint32
		state       uint8
		secs        float64
		queued, all int
	}
	var found []slow
	c.reap() // a request answered directly is not slow, only not yet reaped
	if c.exp.gate.n.Load() > 0 {
		c.exp.gate.prune()
	}
	c.mu.Lock()
	staleAfter := c.exp.gate.ticks(wd)
	for _, r := range c.all {
		c.markStale(r, now, staleAfter)
		if r.state != reqFree && !r.slow && now-r.born >= wd.after {
			r.slow = true
			found = append(found, slow{Op(r.cmd), r.Offset, r.Length, r.state,
				float64(now-r.born) * wd.every.Seconds(), len(c.done), len(c.all) - len(c.free)})
		}
	}
	writing, handoff := c.writing, c.handoff
	inFlight := len(c.all) - len(c.free)
	c.mu.Unlock()
	c.reportUnread(wd, inFlight)
	for _, s := range found {
		where := "in the backend" // or, rarely, a WRITE whose payload the client has not finished sending
		if s.state == reqReply {
			where = "completed, reply not sent"
		}
		c.srv.log.Warn("nbd: slow request", "op", s.op, "offset", s.off, "length", s.length,
			"for", s.secs, "where", where, "remote", remote(c.w.nc),
			"in_flight", s.all, "replies_queued", s.queued, "sending", writing, "handoff", handoff)
	}
}

// slowDone is what is logged of a slow request once it is answered,
// taken before the request is reused.
type slowDone struct {
	op     Op
	off    uint64
	length uint32
	secs   float64
	err    error
}

func (c *conn) slowDone(r *Request) slowDone {
	wd := &c.pool.dog
	return slowDone{Op(r.cmd), r.Offset, r.Length, float64(wd.tick.Load()-r.born) * wd.every.Seconds(), r.err}
}

// sampleUnread counts the ticks for which c's socket has held bytes we
// did not read while no request was read (watchdog goroutine only, under
// wd.mu, which serve's remove takes before the descriptor is closed).
func (c *conn) sampleUnread() {
	n, out := 0, 0
	if c.w.fd >= 0 {
		n, _ = unix.IoctlGetInt(c.w.fd, unix.SIOCINQ)
		out, _ = unix.IoctlGetInt(c.w.fd, unix.SIOCOUTQ)
	}
	// Replies the peer has not read: bytes still queued, no fewer than a
	// tick before. A peer that reads drains them (and a busy one that
	// reads is seen, at some tick, with fewer queued); one that does not
	// keeps them, and more as it goes on sending requests, which the
	// kernel does on a socket it does not read until their timeouts.
	if out > 0 && out >= c.outq {
		c.stuckTicks++
	} else {
		c.stuckTicks = 0
	}
	c.outq = out
	read := c.nread.Load()
	if n <= 0 || read != c.lastRead || c.pausing.Load() { // a paused reader reads nothing on purpose
		c.lastRead, c.unreadTicks, c.unread = read, 0, 0
		return
	}
	c.unreadTicks++
	c.unread = n
}

// reportUnread logs, once, a connection whose socket has held a request
// we did not read for slowAfter ticks: one the kernel sent, and will time
// out on, that never reached the backend (a parked reader not woken, a
// reader stuck before its next read), which the slow-request lines
// cannot show.
func (c *conn) reportUnread(wd *watchdog, inFlight int) {
	if c.stuckTicks == wd.after {
		// Seen in the VM (issue 14): the kernel's nbd driver reads each
		// socket in a work item that runs as long as the socket lives,
		// on a WQ_MEM_RECLAIM workqueue. When the pool is slow to make
		// workers, that workqueue's rescuer takes the pending items and
		// runs them one after another, so the socket whose item waits
		// behind another socket's is never read: our replies sit in it
		// until the kernel times their requests out (30 s) and retries
		// them on another socket.
		// (SIOCOUTQ counts the socket's buffers, a little more than
		// the replies' bytes.)
		c.srv.log.Warn("nbd: peer has not read our replies", "queued_bytes", c.outq,
			"for", float64(c.stuckTicks)*wd.every.Seconds(), "in_flight", inFlight, "remote", remote(c.w.nc))
	}
	if c.unreadTicks != wd.after {
		return
	}
	c.srv.log.Warn("nbd: socket holds a request not read", "unread_bytes", c.unread,
		"for", float64(c.unreadTicks)*wd.every.Seconds(), "parked", c.parked.Load(),
		"in_flight", inFlight, "requests_read", c.lastRead, "remote", remote(c.w.nc))
}
