package nbd

import (
	"sync"
	"sync/atomic"
	"time"
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
	c.mu.Lock()
	for _, r := range c.all {
		if r.state != reqFree && !r.slow && now-r.born >= wd.after {
			r.slow = true
			found = append(found, slow{Op(r.cmd), r.Offset, r.Length, r.state,
				float64(now-r.born) * wd.every.Seconds(), len(c.done), len(c.all) - len(c.free)})
		}
	}
	writing, handoff := c.writing, c.handoff
	c.mu.Unlock()
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
