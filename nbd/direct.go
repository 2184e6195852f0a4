package nbd

import (
	"runtime"
	"sync/atomic"
	"unsafe"
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

// directMax bounds a directly sent reply (header and payload). A unix
// stream socket sends up to 32 KiB plus a page in one buffer, allocated
// whole or not at all: below that, MSG_DONTWAIT is all or nothing.
const directMax = 16 << 10

// Reaper is a backend that finishes directly answered requests only
// when it gets round to it (see Request.DirectReply). The server asks
// it to, so that their buffers come back in time: before its reader
// blocks waiting for the client, when it runs short of requests, and
// before it judges a request slow. Reap must not block on I/O.
type Reaper interface{ Reap() }

// lockGo takes the port for the send-token holder. A foreign holder
// keeps it for one non-blocking system call.
func (p *replyPort) lockGo() {
	for !p.lock.CompareAndSwap(portFree, portGo) {
		runtime.Gosched()
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
		h := r.hdr[:simpleReplySize]
		be.PutUint32(h[0:], magicSimpleReply)
		be.PutUint32(h[4:], 0)
		be.PutUint64(h[8:], r.cookie)
		return unsafe.Pointer(c.port), h, true
	case cmdRead:
		if r.Length == 0 || len(r.Data) != int(r.Length) || int(r.Length)+structuredHeaderSize+8 > directMax {
			return nil, nil, false
		}
		if !c.structured {
			h := r.hdr[:simpleReplySize]
			be.PutUint32(h[0:], magicSimpleReply)
			be.PutUint32(h[4:], 0)
			be.PutUint64(h[8:], r.cookie)
			return unsafe.Pointer(c.port), h, true
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
	one := [1]*Request{r}
	c.recycle(one[:])
}

// Sent is Request.Sent; nothing waits for Flush.
func (b *Batch) Sent(r *Request) { r.Sent() }

// newPort makes c's reply port if its transport allows direct replies:
// a detached unix socket and a backend that reaps.
func (c *conn) newPort() {
	rp, ok := c.be.(Reaper)
	if !ok || c.w.fd < 0 || !c.w.unix || c.srv.cfg.NoDirectReplies {
		return
	}
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
