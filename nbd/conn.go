package nbd

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
)

// conn is one connection in the transmission phase. Its goroutine reads
// requests and submits them; backends complete them from anywhere; one
// writer goroutine sends every reply that is ready in a single writev.
// Under load the writer finds many replies per wake-up, so syscalls per
// request fall as queue depth rises.
//
// Requests, their reply headers and payload buffers are recycled: the
// steady state allocates nothing per request.
type conn struct {
	srv        *Server
	pool       *Shared
	w          *wire
	rd         io.Reader     // the socket
	br         *bufio.Reader // over rd; nil while parked idle
	exp        *Export
	be         Backend
	stats      *Stats // the export's, or nil
	size       uint64
	followSize bool
	tflags     TransmissionFlags
	structured bool
	meta       bool

	mu       sync.Mutex
	cond     sync.Cond // signalled when requests return to free
	free     []*Request
	all      []*Request // every request made (on demand, up to total)
	total    int
	bytes    int          // payload bytes held by requests in flight
	owned    atomic.Int64 // bytes, for budget.waitTake (written under mu)
	maxBytes int
	done     []*Request // completed, waiting for the writer
	// Replies of requests completed inline (inside Submit, on the reader)
	// are left for the reader to send before it next blocks: a burst of
	// requests becomes one send. deferred counts their read payload;
	// woken says a wake-up of the writer is already on its way.
	deferred int
	batched  bool // a Batch holds replies of ours until its Flush
	woken    bool
	wake     chan struct{}
	stop     chan struct{}
	exited   chan struct{}

	// writing: one goroutine (reader or writer) holds the send token;
	// only it touches the send state below. handoff: the reader passed
	// the token, with a half-sent batch, to the writer goroutine.
	writing bool
	handoff bool
	send    sendState

	// Direct replies (direct.go): the port a backend's threads send
	// through, nil when the connection offers none; portHeld, whether
	// the send-token holder has it locked (only that holder touches it).
	port      *replyPort
	portHeld  bool
	directMax int // largest reply (and WRITE payload) offered
	reaper    Reaper
	pin       runtime.Pinner
	tornOnce  sync.Once

	hdr [requestHeaderSize]byte

	// For the watchdog: requests read so far, whether the reader is
	// parked, and (watchdog goroutine only) for how many ticks the
	// socket has held unread bytes while no request was read, and for
	// how many our replies queued for the peer have not grown fewer.
	nread       atomic.Uint64
	parked      atomic.Bool
	lastRead    uint64
	unreadTicks uint32
	unread      int
	stuckTicks  uint32
	outq        int

	// Pausing for a handover (handoff.go). pausing is set while a pause
	// is asked of c: the reader's one look per request. Under mu: pz,
	// that pause; readDone, the reader has returned. nudge wakes a
	// reader parked idle at a request boundary. kernel: served by
	// ServeNegotiated, so a new server can take the socket over.
	pausing  atomic.Bool
	pz       *connPause
	readDone bool
	nudge    chan struct{}
	kernel   bool
}

// connSlots is how many requests' worth of queues a connection starts
// with; they grow (once) to MaxInflight if the client goes that deep.
// Idle and shallow connections, most of a node's, stay small.
const connSlots = 16

func newConn(s *Server, w *wire, rd io.Reader, sess *session) *conn {
	n := s.cfg.MaxInflight
	k := min(n, connSlots)
	c := &conn{
		srv:        s,
		pool:       s.pool,
		w:          w,
		rd:         rd,
		br:         s.pool.reader(rd),
		exp:        sess.exp,
		be:         sess.exp.Backend,
		stats:      sess.exp.Stats,
		size:       sess.size,
		followSize: sess.followSize,
		tflags:     sess.exp.Flags(sess.structured),
		structured: sess.structured,
		meta:       sess.meta,
		total:      n,
		maxBytes:   s.cfg.MaxInflightBytes,
		free:       make([]*Request, 0, k),
		done:       make([]*Request, 0, k),
		wake:       make(chan struct{}, 1),
		stop:       make(chan struct{}),
		exited:     make(chan struct{}),
		nudge:      make(chan struct{}, 1),
		kernel:     sess.kernel,
	}
	c.cond.L = &c.mu
	c.send.init(w, k)
	c.send.sp.on = zeroCopyFor(s.cfg.ZeroCopy, sess.kernel, w.unix)
	c.newPort()
	return c
}

func (c *conn) serve() error {
	if c.stats != nil {
		c.stats.conns.Add(1)
		defer func() { c.stats.conns.Add(-1); c.stats.closed.Add(1) }()
	}
	c.pool.dog.add(c)
	defer c.pool.dog.remove(c)
	go c.writer()
	err := c.readLoop()
	c.readEnded()
	// Every request read must be answered before the socket closes.
	c.waiting(true)
	c.kick()
	c.mu.Lock()
	for len(c.free) < len(c.all) {
		c.cond.Wait()
	}
	c.mu.Unlock()
	c.waiting(false)
	close(c.stop)
	<-c.exited
	// No request is in flight: no backend thread holds the port.
	c.portFail()
	c.pin.Unpin()
	if c.br != nil {
		c.pool.putReader(c.br)
		c.br = nil
	}
	if n := c.send.sp.close(c.w.fd, &c.pool.bufs); n > 0 {
		c.srv.log.Warn("nbd: peer left lent read data unconsumed; leaking it rather than reusing it under the peer",
			"loans", n, "remote", remote(c.w.nc))
	}
	if errors.Is(err, os.ErrDeadlineExceeded) && c.srv.isClosing() || err == errHandedOff {
		err = nil // Shutdown interrupted the read on purpose, or Release took the socket
	}
	return err
}

// acquire takes a free request, waiting while too many are in flight or
// their payloads exceed the connection's byte limit or the pool's budget
// (but never when nothing of ours is in flight, so a single large request
// always proceeds and no connection starves behind the others).
// The request's header fields are set from h under c.mu, where the
// watchdog reads them.
func (c *conn) acquire(payload int, h []byte) *Request {
	c.mu.Lock()
	waiting := false
	for (len(c.free) == 0 && len(c.all) == c.total) || (c.bytes > 0 && c.bytes+payload > c.maxBytes) {
		c.wantSend() // only sending (or reaping direct replies) returns requests
		if c.reaper != nil && !waiting {
			waiting = true
			c.mu.Unlock()
			c.waiting(true)
			c.mu.Lock()
			continue
		}
		c.cond.Wait()
	}
	if waiting {
		c.mu.Unlock()
		c.waiting(false)
		c.mu.Lock()
	}
	switch {
	case payload == 0:
	case c.bytes == 0:
		c.pool.budget.take(payload)
	case !c.pool.budget.tryTake(payload):
		// Wait for others' replies without our lock: our own
		// completions need it to be queued and sent.
		c.wantSend()
		c.mu.Unlock()
		c.waiting(true) // our own answered requests hold budget too
		c.pool.budget.waitTake(payload, &c.owned)
		c.waiting(false)
		c.mu.Lock()
	}
	var r *Request
	if n := len(c.free); n > 0 {
		r = c.free[n-1]
		c.free = c.free[:n-1]
	} else {
		r = &Request{owner: c}
		c.all = append(c.all, r)
	}
	r.state, r.slow, r.stale, r.born = reqBackend, false, false, c.pool.dog.tick.Load()
	r.payloadIn.Store(false)
	r.cookie, r.cflags, r.cmd = be.Uint64(h[8:]), be.Uint16(h[4:]), be.Uint16(h[6:])
	r.Offset, r.Length = be.Uint64(h[16:]), be.Uint32(h[24:])
	c.bytes += payload
	c.owned.Store(int64(c.bytes))
	c.mu.Unlock()
	r.held = payload
	return r
}

// readFull fills p from the socket like io.ReadFull, parking the reader
// in the idle watcher whenever the socket stays quiet for IdleAfter.
// boundary: p is a request header, so a pause may stop the reader
// before its first byte (errPausePoint); never after it.
func (c *conn) readFull(p []byte, boundary bool) error {
	got := 0
	for got < len(p) {
		n, err := c.br.Read(p[got:])
		got += n
		switch {
		case err == nil:
		case err == errIdle:
			if err := c.park(boundary && got == 0); err != nil {
				return err
			}
		case err == io.EOF && got > 0:
			return io.ErrUnexpectedEOF
		default:
			// nil: a pause's deadline cut a message short; read on.
			if err := c.interrupted(err, boundary && got == 0); err != nil {
				return err
			}
		}
	}
	return nil
}

// park waits in the idle watcher until the socket is readable. With
// nothing buffered the read buffer goes back to the pool meanwhile: an
// idle connection keeps no buffer and (see idleWatcher) no thread.
// At a request boundary a pause stops it instead (errPausePoint).
func (c *conn) park(boundary bool) error {
	var nudge <-chan struct{}
	if boundary {
		if c.pausing.Load() {
			return errPausePoint
		}
		nudge = c.nudge
	}
	if c.br.Buffered() == 0 {
		c.pool.putReader(c.br)
		c.br = nil
	}
	c.parked.Store(true)
	nudged, err := c.pool.idle.wait(c.w.fd, nudge)
	c.parked.Store(false)
	if c.br == nil {
		c.br = c.pool.reader(c.rd)
	}
	if err == nil && nudged {
		return errPausePoint
	}
	return err
}

// discard skips n bytes of the socket.
func (c *conn) discard(n int) error {
	for n > 0 {
		m, err := c.br.Discard(n)
		n -= m
		switch {
		case err == nil:
		case err == errIdle:
			if err := c.park(false); err != nil {
				return err
			}
		case err == io.EOF:
			return io.ErrUnexpectedEOF
		default:
			if err := c.interrupted(err, false); err != nil {
				return err
			}
		}
	}
	return nil
}

func (c *conn) readLoop() error {
	for {
		if c.br.Buffered() < requestHeaderSize {
			c.kick() // about to block in read: send what is ready
		}
		if c.pausing.Load() && c.atBoundary() {
			if err := c.pausePoint(); err != nil {
				return err
			}
		}
		if err := c.readFull(c.hdr[:], true); err != nil {
			if err == errPausePoint {
				continue // nothing of a request read: stop at the top
			}
			return err
		}
		c.nread.Add(1)
		h := c.hdr[:]
		if m := be.Uint32(h[0:]); m != magicRequest {
			// Framing is lost: nothing after this can be parsed.
			return fmt.Errorf("%w: bad request magic %#x", errProtocol, m)
		}
		cflags, cmd := be.Uint16(h[4:]), be.Uint16(h[6:])
		length := be.Uint32(h[24:])
		if cmd == cmdDisc {
			return nil
		}
		payload := 0
		if (cmd == cmdRead || cmd == cmdWrite) && length <= MaxPayload {
			payload = int(length)
		}
		r := c.acquire(payload, h)
		r.err, r.Extents = nil, r.Extents[:0]
		if c.stats != nil {
			r.tRead, r.tSubmit = c.stats.now(), 0
		}
		if e := c.check(r); e != 0 {
			if cmd == cmdWrite {
				// The payload is on the wire whatever we think of it.
				if err := c.discard(int(length)); err != nil {
					c.recycle([]*Request{r})
					return err
				}
			}
			r.err = e
			c.complete(r)
			continue
		}
		if payload > 0 {
			r.buf = c.pool.bufs.get(payload)
			r.Data = r.buf.b
			if cmd == cmdWrite {
				if c.br.Buffered() < payload {
					c.kick() // the payload read will block
				}
				if err := c.readFull(r.Data, false); err != nil {
					c.recycle([]*Request{r})
					return err
				}
			}
		}
		r.payloadIn.Store(true)
		r.Op = Op(cmd)
		r.Flags = c.backendFlags(cmd, cflags)
		if length == 0 && cmd != cmdFlush {
			c.complete(r) // nothing to do; a zero-length READ gets an empty reply
			continue
		}
		if g := c.exp.gate; g.n.Load() > 0 && writeLike(r.cmd) && g.overlaps(r) {
			first := g.dupOf(r)
			c.gate(r, true)
			g.wait(r)
			if first != nil && g.succeeded(first) {
				c.ungate(r)
				c.srv.log.Warn("nbd: answered a kernel retry with its first copy's result, which it waited for",
					"op", r.Op, "offset", r.Offset, "length", r.Length, "remote", remote(c.w.nc))
				c.complete(r)
				continue
			}
			c.gate(r, false)
			c.srv.log.Warn("nbd: held a write until an overlapping one sent before a kernel retry left the backend",
				"op", r.Op, "offset", r.Offset, "length", r.Length, "remote", remote(c.w.nc))
		}
		if c.stats != nil {
			c.stats.submitted(r)
		}
		r.inSubmit.Store(true)
		c.be.Submit(r)
		r.inSubmit.Store(false)
	}
}

// gate marks r held by the stale gate, or released from it. A request
// released past the stale mark is marked at once, before it is
// submitted: the kernel may have sent it again already, and a newer
// write must not overtake it in the backend (the watchdog's next tick
// could be too late).
func (c *conn) gate(r *Request, held bool) {
	c.mu.Lock()
	r.gated = held
	if !held {
		c.markStale(r, c.pool.dog.tick.Load(), c.exp.gate.ticks(&c.pool.dog))
	}
	c.mu.Unlock()
}

// ungate releases r from the stale gate without marking it: it is
// answered without reaching the backend.
func (c *conn) ungate(r *Request) {
	c.mu.Lock()
	r.gated = false
	c.mu.Unlock()
}

// markStale marks r on the stale gate if it is in the backend, not held,
// and at least after ticks old at tick now (c.mu held).
func (c *conn) markStale(r *Request, now, after uint32) {
	if r.state == reqBackend && !r.stale && !r.gated && now-r.born >= after {
		r.stale = true
		c.exp.gate.mark(c, r)
	}
}

// check validates a request against the protocol and what was
// advertised, returning the NBD error to reply with (0 if valid).
func (c *conn) check(r *Request) Errno {
	allowed := uint16(0)
	if c.tflags&FlagSendFUA != 0 {
		allowed |= cmdFlagFUA // clients set it on any command; harmless
	}
	var need TransmissionFlags
	writes := false
	switch r.cmd {
	case cmdRead:
		if c.tflags&FlagSendDF != 0 {
			allowed |= cmdFlagDF
		}
	case cmdWrite:
		writes = true
	case cmdFlush:
		need = FlagSendFlush
	case cmdTrim:
		need, writes = FlagSendTrim, true
	case cmdWriteZeroes:
		need, writes = FlagSendWriteZeroes, true
		allowed |= cmdFlagNoHole
		if c.tflags&FlagSendFastZero != 0 {
			allowed |= cmdFlagFastZero
		}
	case cmdCache:
		need = FlagSendCache
	case cmdBlockStatus:
		if !c.meta {
			return ErrInvalid
		}
		allowed |= cmdFlagReqOne
	default:
		return ErrInvalid
	}
	if c.tflags&need != need || r.cflags&^allowed != 0 {
		return ErrInvalid
	}
	if writes && c.tflags&FlagReadOnly != 0 {
		return ErrPerm
	}
	if r.Length > MaxPayload {
		switch r.cmd {
		case cmdRead:
			return ErrOverflow
		case cmdWrite:
			return ErrInvalid
		}
	}
	if r.cmd == cmdFlush {
		if r.Offset != 0 || r.Length != 0 {
			return ErrInvalid
		}
		return 0
	}
	size := c.size
	if c.followSize {
		size = c.be.Size()
	}
	if r.Offset > size || uint64(r.Length) > size-r.Offset {
		if r.cmd == cmdWrite || r.cmd == cmdWriteZeroes {
			return ErrNoSpace
		}
		return ErrInvalid
	}
	if r.cmd == cmdBlockStatus && r.Length == 0 {
		return ErrInvalid
	}
	return 0
}

// backendFlags passes on only the flags that mean something for the op.
func (c *conn) backendFlags(cmd, cflags uint16) ReqFlags {
	var mask uint16
	switch cmd {
	case cmdWrite, cmdTrim:
		mask = cmdFlagFUA
	case cmdWriteZeroes:
		mask = cmdFlagFUA | cmdFlagNoHole | cmdFlagFastZero
	case cmdBlockStatus:
		mask = cmdFlagReqOne
	}
	return ReqFlags(cflags & mask)
}

func (c *conn) recycle(batch []*Request) {
	for _, r := range batch {
		c.releaseBuf(r)
	}
	held := 0
	var slow []slowDone
	c.mu.Lock()
	for _, r := range batch {
		held += r.held
		r.state = reqFree
		if r.slow {
			slow = append(slow, c.slowDone(r))
		}
		c.free = append(c.free, r)
	}
	c.bytes -= held
	c.owned.Store(int64(c.bytes))
	c.mu.Unlock()
	c.pool.budget.give(held)
	c.cond.Signal()
	for _, s := range slow {
		c.srv.log.Warn("nbd: slow request answered", "op", s.op, "offset", s.off, "length", s.length,
			"after", s.secs, "err", s.err, "remote", remote(c.w.nc))
	}
	clear(batch)
}

func (c *conn) releaseBuf(r *Request) {
	if r.buf != nil {
		c.pool.bufs.put(r.buf)
		r.buf, r.Data = nil, nil
	}
	if r.loan != nil {
		r.loan.Release()
		r.loan = nil
	}
}
