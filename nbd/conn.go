package nbd

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
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
	w          *wire
	br         *bufio.Reader
	exp        *Export
	be         Backend
	size       uint64
	followSize bool
	tflags     TransmissionFlags
	structured bool
	meta       bool

	mu       sync.Mutex
	cond     sync.Cond // signalled when requests return to free
	free     []*Request
	total    int
	bytes    int // payload bytes held by requests in flight
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

	hdr [requestHeaderSize]byte
}

func newConn(s *Server, w *wire, br *bufio.Reader, sess *session) *conn {
	n := s.cfg.MaxInflight
	c := &conn{
		srv:        s,
		w:          w,
		br:         br,
		exp:        sess.exp,
		be:         sess.exp.Backend,
		size:       sess.size,
		followSize: sess.followSize,
		tflags:     sess.exp.Flags(sess.structured),
		structured: sess.structured,
		meta:       sess.meta,
		total:      n,
		maxBytes:   s.cfg.MaxInflightBytes,
		free:       make([]*Request, n),
		done:       make([]*Request, 0, n),
		wake:       make(chan struct{}, 1),
		stop:       make(chan struct{}),
		exited:     make(chan struct{}),
	}
	c.cond.L = &c.mu
	c.send.init(w, n)
	c.send.sp.on = zeroCopyFor(s.cfg.ZeroCopy, sess.kernel, w.unix)
	reqs := make([]Request, n)
	for i := range reqs {
		reqs[i].owner = c
		c.free[i] = &reqs[i]
	}
	return c
}

func (c *conn) serve() error {
	go c.writer()
	err := c.readLoop()
	// Every request read must be answered before the socket closes.
	c.kick()
	c.mu.Lock()
	for len(c.free) < c.total {
		c.cond.Wait()
	}
	c.mu.Unlock()
	close(c.stop)
	<-c.exited
	if n := c.send.sp.close(c.w.fd, &c.srv.bufs); n > 0 {
		c.srv.log.Warn("nbd: peer left lent read data unconsumed; leaking it rather than reusing it under the peer",
			"loans", n, "remote", remote(c.w.nc))
	}
	if errors.Is(err, os.ErrDeadlineExceeded) && c.srv.isClosing() {
		err = nil // Shutdown interrupted the read on purpose
	}
	return err
}

// acquire takes a free request, waiting while too many are in flight or
// their payloads exceed the byte budget (but never when nothing is in
// flight, so a single large request always proceeds).
func (c *conn) acquire(payload int) *Request {
	c.mu.Lock()
	for len(c.free) == 0 || (c.bytes > 0 && c.bytes+payload > c.maxBytes) {
		c.wantSend() // only sending returns requests
		c.cond.Wait()
	}
	r := c.free[len(c.free)-1]
	c.free = c.free[:len(c.free)-1]
	c.bytes += payload
	c.mu.Unlock()
	r.held = payload
	return r
}

func (c *conn) readLoop() error {
	for {
		if c.br.Buffered() < requestHeaderSize {
			c.kick() // about to block in read: send what is ready
		}
		if _, err := io.ReadFull(c.br, c.hdr[:]); err != nil {
			return err
		}
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
		r := c.acquire(payload)
		r.cookie, r.cmd, r.cflags = be.Uint64(h[8:]), cmd, cflags
		r.Offset, r.Length = be.Uint64(h[16:]), length
		r.err, r.Extents = nil, r.Extents[:0]
		if e := c.check(r); e != 0 {
			if cmd == cmdWrite {
				// The payload is on the wire whatever we think of it.
				if _, err := io.CopyN(io.Discard, c.br, int64(length)); err != nil {
					c.recycle([]*Request{r})
					return err
				}
			}
			r.err = e
			c.complete(r)
			continue
		}
		if payload > 0 {
			r.buf = c.srv.bufs.get(payload)
			r.Data = r.buf.b
			if cmd == cmdWrite {
				if c.br.Buffered() < payload {
					c.kick() // the payload read will block
				}
				if _, err := io.ReadFull(c.br, r.Data); err != nil {
					c.recycle([]*Request{r})
					return err
				}
			}
		}
		r.Op = Op(cmd)
		r.Flags = c.backendFlags(cmd, cflags)
		if length == 0 && cmd != cmdFlush {
			c.complete(r) // nothing to do; a zero-length READ gets an empty reply
			continue
		}
		r.inSubmit.Store(true)
		c.be.Submit(r)
		r.inSubmit.Store(false)
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
	c.mu.Lock()
	for _, r := range batch {
		c.bytes -= r.held
		c.free = append(c.free, r)
	}
	c.mu.Unlock()
	c.cond.Signal()
	clear(batch)
}

func (c *conn) releaseBuf(r *Request) {
	if r.buf != nil {
		c.srv.bufs.put(r.buf)
		r.buf, r.Data = nil, nil
	}
	if r.loan != nil {
		r.loan.Release()
		r.loan = nil
	}
}
