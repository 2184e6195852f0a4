package nbd

import (
	"net"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Sending replies. Whoever holds the send token (conn.writing) encodes the
// ready replies and writes them in one vectored call. The reader, just
// before it would block in read, tries a non-blocking sendmsg itself: for
// a backend that completes inline (memory) a burst of requests then costs
// one read and one send and no goroutine hand-off at all. If the socket
// is full, the rest goes to the writer goroutine, which may block: the
// reader must keep reading, or a client that writes before it reads would
// deadlock against us.

// maxDeferred caps reply payload held back while the reader is busy, so
// large reads still stream out while later ones are being served.
const maxDeferred = 256 << 10

const iovMax = 1024 // IOV_MAX on Linux

type sendState struct {
	w     *wire
	batch []*Request
	iov   [][]byte
	// nb is the run of iov being copied out, iov[..:end]; at end, when
	// end < len(iov), starts the payload of zc[zi], to be spliced.
	nb     net.Buffers
	end    int
	zc     []spliceReply
	zi     int
	iovecs []unix.Iovec
	msg    unix.Msghdr
	err    error // the connection is dead for writing
	sp     spliceState
}

func (s *sendState) init(w *wire, n int) {
	s.w = w
	s.batch = make([]*Request, 0, n)
	s.iov = make([][]byte, 0, 2*n)
	s.iovecs = make([]unix.Iovec, 2*n)
	s.zc = make([]spliceReply, 0, n)
}

// sendmsg sends as much of s.nb as one call takes and consumes it.
// Blocking unless dontWait; EAGAIN is returned as is.
func (s *sendState) sendmsg(dontWait bool) error {
	n := min(len(s.nb), iovMax)
	if n > len(s.iovecs) {
		s.iovecs = make([]unix.Iovec, min(max(n, 2*len(s.iovecs)), iovMax))
	}
	for i, b := range s.nb[:n] {
		s.iovecs[i].Base = &b[0]
		s.iovecs[i].SetLen(len(b))
	}
	s.msg.Iov = &s.iovecs[0]
	s.msg.SetIovlen(n)
	flags := uintptr(unix.MSG_NOSIGNAL)
	if dontWait {
		flags |= unix.MSG_DONTWAIT
	}
	for {
		sent, _, e := unix.Syscall(unix.SYS_SENDMSG, uintptr(s.w.fd), uintptr(unsafe.Pointer(&s.msg)), flags)
		if e == unix.EINTR {
			continue
		}
		if e != 0 {
			return e
		}
		consume(&s.nb, int(sent))
		s.sp.sent += uint64(sent)
		return nil
	}
}

// complete is called by backends (via Request.Complete) from any
// goroutine, and by the reader for requests it answers itself.
//
// Whether the completion is inline is read under c.mu, after r is in
// c.done: the reader clears inSubmit before its kick takes c.mu, so
// either we see it cleared and wake the writer, or its kick comes after
// us and finds r. Read before the lock, a completion from another
// goroutine could see the flag still set, miss the reader's kick, and
// leave its reply unsent until the next request arrived (forever, for a
// client's last FLUSH).
func (c *conn) complete(r *Request) {
	if c.stats != nil {
		c.stats.done(r)
	}
	c.mu.Lock()
	c.leftBackend(r)
	c.done = append(c.done, r)
	if r.cmd == cmdRead {
		c.deferred += len(r.Data)
	}
	if !r.inSubmit.Load() || c.deferred >= maxDeferred {
		c.wantSend()
	}
	c.mu.Unlock()
}

// leftBackend records that r has left the backend (c.mu held): on the
// stale gate, if it was stale there or writes (stale.go), and in its
// state, so the watchdog marks it no more.
func (c *conn) leftBackend(r *Request) {
	if r.stale {
		c.exp.gate.finished(r)
	}
	if writeLike(r.cmd) {
		c.exp.gate.wrote(r.Offset, r.Length, c.pool.dog.tick.Load())
	}
	r.state = reqReply
}

// completeDeferred queues r for a Batch without waking anyone; true
// when the batch must remember c (the first since its last flush).
func (c *conn) completeDeferred(r *Request) bool {
	if c.stats != nil {
		c.stats.done(r)
	}
	c.mu.Lock()
	c.leftBackend(r)
	c.done = append(c.done, r)
	first := !c.batched
	c.batched = true
	c.mu.Unlock()
	return first
}

// flushDeferred sends the replies a Batch queued, as the reader does
// before it blocks.
func (c *conn) flushDeferred() {
	c.mu.Lock()
	c.batched = false
	ok := c.grab()
	c.mu.Unlock()
	if ok {
		c.sendGrabbed()
	}
}

// wantSend makes sure somebody will send c.done (c.mu held): the token
// holder looks again when it releases; otherwise wake the writer.
func (c *conn) wantSend() {
	if c.writing || len(c.done) == 0 {
		return
	}
	c.deferred = 0
	c.wakeWriter()
}

// wakeWriter (c.mu held). The channel holds a wake-up only while woken
// is set, so the send never blocks.
func (c *conn) wakeWriter() {
	if !c.woken {
		c.woken = true
		c.wake <- struct{}{}
	}
}

// grab takes the send token and the ready replies (c.mu held).
func (c *conn) grab() bool {
	if c.writing || len(c.done) == 0 {
		return false
	}
	c.writing = true
	c.send.batch, c.done = c.done, c.send.batch[:0]
	c.deferred = 0
	return true
}

// kick is the reader's turn before it blocks: send what is ready without
// blocking, hand any remainder to the writer.
func (c *conn) kick() {
	c.reap()
	c.mu.Lock()
	ok := c.grab()
	c.mu.Unlock()
	if ok {
		c.sendGrabbed()
	}
}

// sendGrabbed sends the batch grab took, without blocking; a remainder
// goes to the writer goroutine.
func (c *conn) sendGrabbed() {
	c.encode()
	c.portLock() // kept across a hand-off: a reply may be half sent
	if c.send.err == nil && !c.trySend() {
		c.mu.Lock()
		c.handoff = true
		c.wakeWriter()
		c.mu.Unlock()
		return
	}
	c.release()
}

func (c *conn) writer() {
	defer close(c.exited)
	for {
		select {
		case <-c.wake:
		case <-c.stop:
			return
		}
		c.mu.Lock()
		c.woken = false
		c.mu.Unlock()
		for c.writeRound() {
		}
	}
}

// writeRound sends one batch (a handed-over one, or whatever is ready),
// blocking as long as it takes; false when there was nothing to send.
func (c *conn) writeRound() bool {
	c.mu.Lock()
	resume := c.handoff
	c.handoff = false
	if !resume && !c.grab() {
		c.mu.Unlock()
		return false
	}
	c.mu.Unlock()
	if !resume {
		c.encode()
	}
	c.portLock()
	for c.send.err == nil && c.send.pending() {
		var err error
		switch {
		case len(c.send.nb) == 0:
			err = c.spliceNext()
		case c.w.fd >= 0:
			err = c.send.sendmsg(false)
		default:
			_, err = c.send.nb.WriteTo(c.w.nc)
		}
		if err != nil {
			c.fail(err)
		}
	}
	c.release()
	return true
}

// spliceNext sends the payload at the end of the copied run by reference
// and moves on to the next run.
func (c *conn) spliceNext() error {
	s := &c.send
	z := s.zc[s.zi]
	err := s.sp.splice(c.w.fd, s.iov[s.end:s.end+z.n])
	if err == nil {
		c.srv.spliced.Add(uint64(z.r.Length))
		if c.stats != nil {
			c.stats.spliced.Add(uint64(z.r.Length))
		}
	}
	// Parked even after an error: part of it may be in the socket.
	s.sp.park(z.r)
	s.zi++
	s.window(s.end + z.n)
	return err
}

// pending reports whether any of the batch is still to be sent.
func (s *sendState) pending() bool { return len(s.nb) > 0 || s.end < len(s.iov) }

// window makes nb the run of iov from start to the next payload to
// splice (or to the end).
func (s *sendState) window(start int) {
	s.end = len(s.iov)
	if s.zi < len(s.zc) {
		s.end = s.zc[s.zi].at
	}
	s.nb = s.iov[start:s.end]
}

// encode turns the batch's replies into c.send.iov, noting the payloads
// to splice, and reclaims payloads spliced earlier that the peer has read.
func (c *conn) encode() {
	s := &c.send
	iov := s.iov[:0]
	s.zc, s.zi = s.zc[:0], 0
	for _, r := range s.batch {
		at := len(iov) + 1 // a READ's payload follows its one header
		iov = c.appendReply(iov, r)
		if s.sp.spliceable(r) {
			s.zc = append(s.zc, spliceReply{r, at, len(iov) - at})
		}
	}
	s.iov = iov
	s.window(0)
	if s.sp.on {
		s.sp.reclaim(c.w.fd, &c.pool.bufs)
	}
}

// trySend writes c.send.nb without blocking; false if some is left,
// including a payload to splice: splicing may block, so it is the
// writer goroutine's job.
func (c *conn) trySend() bool {
	if c.w.fd < 0 {
		return len(c.send.nb) == 0
	}
	for len(c.send.nb) > 0 {
		switch err := c.send.sendmsg(true); err {
		case nil:
		case unix.EAGAIN:
			return false
		default:
			c.fail(err)
			return true
		}
	}
	return !c.send.pending()
}

// consume drops the first n bytes of b.
func consume(b *net.Buffers, n int) {
	for n > 0 {
		if n < len((*b)[0]) {
			(*b)[0] = (*b)[0][n:]
			return
		}
		n -= len((*b)[0])
		*b = (*b)[1:]
	}
	for len(*b) > 0 && len((*b)[0]) == 0 {
		*b = (*b)[1:]
	}
}

// fail records that the client is gone. Replies are dropped from now on,
// but requests keep being recycled so the reader can drain.
func (c *conn) fail(err error) {
	c.send.err = err
	c.portFail()
	c.w.abort()
}

// release recycles the sent batch and gives the token back, waking the
// writer if more replies arrived meanwhile and nobody else will send them.
func (c *conn) release() {
	clear(c.send.iov) // drop references to recycled buffers
	c.send.iov = c.send.iov[:0]
	c.send.nb = nil
	c.send.end = 0
	clear(c.send.zc)
	c.send.zc, c.send.zi = c.send.zc[:0], 0
	c.recycle(c.send.batch)
	c.send.batch = c.send.batch[:0]
	c.portUnlock()
	c.mu.Lock()
	c.writing = false
	c.wantSend()
	c.mu.Unlock()
}
