package nbd

import (
	"runtime"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Direct replies. A backend whose completions arrive on threads of its
// own (librbd's) may send a request's success reply from that thread,
// with one non-blocking sendmsg, instead of handing the completion to a
// goroutine that sends it: on the 4k path that hand-off (an eventfd
// write, a netpoller wake-up, the scheduler) costs more than the send.
// The backend then finishes the request later, in batches, with Sent:
// only buffers and the request go back to the pool, nothing is sent.
//
// The socket is shared with the connection's own sender, so both take
// the port's lock around a send, the foreign thread only with a
// try-lock: if Go holds it (perhaps blocked on a full socket), or the
// send would block, the backend completes the request the usual way.
// A reply is offered only on unix sockets and only when it fits one
// socket buffer (directMax): a non-blocking send of it there is all or
// nothing, so a foreign send never leaves half a reply for Go to
// finish. A sender that ever sees a partial send must end the
// connection (portTorn): the stream is lost, as after any failed send.
//
// The port is pinned while the connection lives; its layout is an ABI
// shared with C (rbdio's struct nbdgo_port), checked by a test.
type replyPort struct {
	lock atomic.Uint32 // portFree, portForeign or portGo
	fd   int32         // the socket; valid while a request is in flight
	dead atomic.Uint32 // portLive, portDead or portTorn
}

// Port lock states.
const (
	portFree    uint32 = 0
	portForeign uint32 = 1 // a backend thread, for one non-blocking sendmsg
	portGo      uint32 = 2 // the connection's send-token holder, for a batch
)

// Port liveness.
const (
	portLive uint32 = 0
	portDead uint32 = 1 // the connection failed: nobody sends any more
	portTorn uint32 = 2 // a foreign send went out in part; it shut the socket down
)

// directMax bounds a directly sent reply (header and payload), and a
// directly answered WRITE's payload, which waits to be reaped. A unix
// stream socket sends up to 32 KiB plus a page, and at most half its
// send buffer less 64 bytes, in one buffer allocated whole or not at
// all: within that, MSG_DONTWAIT is all or nothing. A connection's own
// bound (conn.directMax) also honours its send buffer.
const directMax = 16 << 10

// Reaper is a backend that finishes directly answered requests only
// when it gets round to it (see Request.DirectReply). The server asks
// it to, so that their buffers come back in time. Reap, before its
// reader blocks waiting for the client and before the watchdog judges
// a request slow, finishes what is ready, or nothing if another caller
// is at it already. Waiting(true), before the server waits for its
// requests to come back (short of requests or budget, or closing),
// finishes every request answered so far, and until Waiting(false)
// the backend finishes each one it answers without delay. Neither may
// block on I/O.
type Reaper interface {
	Reap()
	Waiting(on bool)
}

// lockGo takes the port for the send-token holder. A foreign holder
// keeps it for one non-blocking system call, unless the kernel
// preempted it meanwhile: then give it the CPU.
func (p *replyPort) lockGo() {
	for i := 0; !p.lock.CompareAndSwap(portFree, portGo); i++ {
		if i < 4 {
			runtime.Gosched()
		} else {
			unix.Syscall(unix.SYS_SCHED_YIELD, 0, 0, 0)
		}
	}
}

func (p *replyPort) unlock() { p.lock.Store(portFree) }

// DirectReply offers r's success reply for the backend to send itself.
// ok is false when it may not: the backend then completes r as usual.
// Otherwise, if r succeeds, the backend may send hdr followed by r.Data
// (READ only) through the port, under its lock as described above, and
// finish r with Sent; if it fails, or the send does not go out whole,
// it completes r with Complete as usual. hdr stays valid until r is
// finished. The backend must not offer a reply before r is complete in
// every respect (a FUA write's flush included).
func (r *Request) DirectReply() (port unsafe.Pointer, hdr []byte, ok bool) {
	c, isConn := r.owner.(*conn)
	if !isConn || c.port == nil || r.loan != nil || c.port.dead.Load() != portLive {
		return nil, nil, false
	}
	switch r.cmd {
	case cmdWrite, cmdFlush, cmdTrim, cmdWriteZeroes:
		if r.cmd == cmdWrite && int(r.Length) > c.directMax {
			return nil, nil, false
		}
		return unsafe.Pointer(c.port), putSimpleReply(r.hdr[:], 0, r.cookie), true
	case cmdRead:
		if r.Length == 0 || len(r.Data) != int(r.Length) || int(r.Length)+structuredHeaderSize+8 > c.directMax {
			return nil, nil, false
		}
		if !c.structured {
			return unsafe.Pointer(c.port), putSimpleReply(r.hdr[:], 0, r.cookie), true
		}
		h := r.hdr[:structuredHeaderSize+8]
		putChunkHeader(h, replyTypeOffsetData, r.cookie, 8+int(r.Length))
		be.PutUint64(h[20:], r.Offset)
		return unsafe.Pointer(c.port), h, true
	}
	return nil, nil, false
}

// Sent finishes r, whose success reply the backend sent itself.
func (r *Request) Sent() {
	c := r.owner.(*conn)
	r.err = nil
	if c.stats != nil {
		c.stats.done(r)
	}
	// Out of the backend, under c.mu, before recycle lets its buffer go:
	// the watchdog may mark it stale until then, and the stale gate reads
	// a stale write's payload until it is finished.
	c.mu.Lock()
	c.leftBackend(r)
	c.mu.Unlock()
	one := [1]*Request{r}
	c.recycle(one[:])
}

// newPort makes c's reply port if its transport allows direct replies:
// a detached unix socket and a backend that reaps.
func (c *conn) newPort() {
	rp, ok := c.be.(Reaper)
	if !ok || c.w.fd < 0 || !c.w.unix || c.srv.cfg.NoDirectReplies {
		return
	}
	sb, err := unix.GetsockoptInt(c.w.fd, unix.SOL_SOCKET, unix.SO_SNDBUF)
	if err != nil || sb/2-64 < 4096+structuredHeaderSize+8 {
		return
	}
	c.directMax = min(directMax, sb/2-64)
	c.reaper = rp
	c.port = &replyPort{fd: int32(c.w.fd)}
	c.pin.Pin(c.port)
}

// reap asks the backend to finish what it answered directly (c.mu not
// held: finishing requests takes it).
func (c *conn) reap() {
	if c.reaper != nil {
		c.reaper.Reap()
	}
}

// waiting tells the backend whether c waits for requests to come back
// (c.mu not held).
func (c *conn) waiting(on bool) {
	if c.reaper != nil {
		c.reaper.Waiting(on)
	}
}

// portLock takes the port around the send-token holder's sending, if
// the connection has one.
func (c *conn) portLock() {
	if c.port != nil && !c.portHeld {
		c.port.lockGo()
		c.portHeld = true
	}
}

func (c *conn) portUnlock() {
	if c.portHeld {
		c.portHeld = false
		c.port.unlock()
	}
}

// portFail stops foreign sends on a failed connection.
func (c *conn) portFail() {
	if c.port != nil && c.port.dead.CompareAndSwap(portLive, portDead) {
		return
	}
	if c.port != nil && c.port.dead.Load() == portTorn {
		c.tornOnce.Do(func() {
			c.srv.log.Error("nbd: a reply sent by the backend went out in part; connection ended",
				"remote", remote(c.w.nc))
		})
	}
}
