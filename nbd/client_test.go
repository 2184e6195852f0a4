package nbd

import (
	"bufio"
	"context"
	"encoding/binary"
	"io"
	"net"
	"os"
	"syscall"
	"testing"
	"time"
)

// tclient is a deliberately low-level NBD client: tests need to send
// what a well-behaved client never would.
type tclient struct {
	t  testing.TB
	c  net.Conn
	br *bufio.Reader
}

type optReply struct {
	opt, typ uint32
	data     []byte
}

type reply struct {
	cookie     uint64
	errno      uint32
	data       []byte   // READ payload (simple or OFFSET_DATA)
	offset     uint64   // OFFSET_DATA offset
	extents    []Extent // BLOCK_STATUS descriptors
	ctxID      uint32
	msg        string // structured error message
	structured bool
}

// socketpair gives two connected unix stream sockets as net.Conns: real
// kernel buffering, unlike net.Pipe, so pipelined tests cannot deadlock.
func socketpair(t testing.TB) (net.Conn, net.Conn) {
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	conv := func(fd int) net.Conn {
		f := os.NewFile(uintptr(fd), "sp")
		defer f.Close()
		c, err := net.FileConn(f)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	return conv(fds[0]), conv(fds[1])
}

// connect starts ServeConn on one end and returns a client on the other.
func connect(t testing.TB, s *Server) *tclient {
	a, b := socketpair(t)
	go s.ServeConn(a)
	c := &tclient{t: t, c: b, br: bufio.NewReader(b)}
	t.Cleanup(func() { b.Close() })
	b.SetDeadline(time.Now().Add(20 * time.Second))
	return c
}

// dialTest connects a client to s, over TCP or (connect) a socketpair,
// and shuts s down at the end of the test.
func dialTest(t testing.TB, s *Server, tcp bool) *tclient {
	t.Helper()
	t.Cleanup(func() { s.Shutdown(context.Background()) })
	if !tcp {
		return connect(t, s)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go s.Serve(ln)
	nc, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { nc.Close() })
	return &tclient{t: t, c: nc, br: bufio.NewReader(nc)}
}

func (c *tclient) read(n int) []byte {
	c.t.Helper()
	b := make([]byte, n)
	if _, err := io.ReadFull(c.br, b); err != nil {
		c.t.Fatalf("read %d bytes: %v", n, err)
	}
	return b
}

func (c *tclient) write(b []byte) {
	c.t.Helper()
	if _, err := c.c.Write(b); err != nil {
		c.t.Fatalf("write: %v", err)
	}
}

// greet reads the greeting and sends client flags.
func (c *tclient) greet(flags uint32) {
	c.t.Helper()
	g := c.read(18)
	if be.Uint64(g) != magicInit || be.Uint64(g[8:]) != magicOpt {
		c.t.Fatalf("bad greeting % x", g)
	}
	if hf := be.Uint16(g[16:]); hf != hsFixedNewstyle|hsNoZeroes {
		c.t.Fatalf("handshake flags %#x", hf)
	}
	c.write(binary.BigEndian.AppendUint32(nil, flags))
}

func (c *tclient) sendOpt(opt uint32, data []byte) {
	b := be.AppendUint64(nil, magicOpt)
	b = be.AppendUint32(b, opt)
	b = be.AppendUint32(b, uint32(len(data)))
	c.write(append(b, data...))
}

func (c *tclient) optReply() optReply {
	c.t.Helper()
	h := c.read(20)
	if be.Uint64(h) != magicOptReply {
		c.t.Fatalf("bad option reply magic % x", h)
	}
	r := optReply{opt: be.Uint32(h[8:]), typ: be.Uint32(h[12:])}
	r.data = c.read(int(be.Uint32(h[16:])))
	return r
}

// opt sends an option and collects replies up to the final one.
func (c *tclient) opt(opt uint32, data []byte) []optReply {
	c.t.Helper()
	c.sendOpt(opt, data)
	var rs []optReply
	for {
		r := c.optReply()
		if r.opt != opt {
			c.t.Fatalf("reply for option %d, want %d", r.opt, opt)
		}
		rs = append(rs, r)
		if r.typ == repAck || r.typ&(1<<31) != 0 {
			return rs
		}
	}
}

func goData(name string, infos ...uint16) []byte {
	b := be.AppendUint32(nil, uint32(len(name)))
	b = append(b, name...)
	b = be.AppendUint16(b, uint16(len(infos)))
	for _, i := range infos {
		b = be.AppendUint16(b, i)
	}
	return b
}

func metaData(export string, queries ...string) []byte {
	b := be.AppendUint32(nil, uint32(len(export)))
	b = append(b, export...)
	b = be.AppendUint32(b, uint32(len(queries)))
	for _, q := range queries {
		b = be.AppendUint32(b, uint32(len(q)))
		b = append(b, q...)
	}
	return b
}

// open does a full modern handshake: structured replies and
// base:allocation when structured, then GO. It returns size and flags.
func (c *tclient) open(export string, structured bool) (uint64, TransmissionFlags) {
	c.t.Helper()
	c.greet(clientFixedNewstyle | clientNoZeroes)
	if structured {
		if r := c.opt(optStructuredReply, nil); r[0].typ != repAck {
			c.t.Fatalf("structured reply refused: %#x", r[0].typ)
		}
		if r := c.opt(optSetMetaContext, metaData(export, metaBaseAllocation)); len(r) != 2 {
			c.t.Fatalf("SET_META_CONTEXT: %d replies", len(r))
		}
	}
	var size uint64
	var flags TransmissionFlags
	for _, r := range c.opt(optGo, goData(export)) {
		switch {
		case r.typ == repInfo && be.Uint16(r.data) == infoExport:
			size, flags = be.Uint64(r.data[2:]), TransmissionFlags(be.Uint16(r.data[10:]))
		case r.typ&(1<<31) != 0:
			c.t.Fatalf("GO refused: %#x %s", r.typ, r.data)
		}
	}
	return size, flags
}

func (c *tclient) send(cmd, flags uint16, cookie, off uint64, length uint32, payload []byte) {
	c.t.Helper()
	b := make([]byte, requestHeaderSize, requestHeaderSize+len(payload))
	be.PutUint32(b[0:], magicRequest)
	be.PutUint16(b[4:], flags)
	be.PutUint16(b[6:], cmd)
	be.PutUint64(b[8:], cookie)
	be.PutUint64(b[16:], off)
	be.PutUint32(b[24:], length)
	c.write(append(b, payload...))
}

// recv reads one whole reply. readLen says how much data a simple READ
// reply carries: simple replies are not self-describing.
func (c *tclient) recv(readLen int) reply {
	c.t.Helper()
	h := c.read(4)
	switch be.Uint32(h) {
	case magicSimpleReply:
		h = c.read(12)
		r := reply{errno: be.Uint32(h), cookie: be.Uint64(h[4:])}
		if r.errno == 0 && readLen > 0 {
			r.data = c.read(readLen)
		}
		return r
	case magicStructuredRepl:
		r := reply{structured: true}
		for {
			h = c.read(16)
			flags, typ := be.Uint16(h), be.Uint16(h[2:])
			r.cookie = be.Uint64(h[4:])
			p := c.read(int(be.Uint32(h[12:])))
			switch typ {
			case replyTypeOffsetData:
				r.offset, r.data = be.Uint64(p), p[8:]
			case replyTypeBlockStatus:
				r.ctxID = be.Uint32(p)
				for p = p[4:]; len(p) >= 8; p = p[8:] {
					r.extents = append(r.extents, Extent{Length: be.Uint32(p), Flags: be.Uint32(p[4:])})
				}
			case replyTypeError:
				r.errno = be.Uint32(p)
				r.msg = string(p[6 : 6+be.Uint16(p[4:])])
			case replyTypeNone:
			default:
				c.t.Fatalf("unexpected chunk type %d", typ)
			}
			if flags&replyFlagDone != 0 {
				return r
			}
		}
	}
	c.t.Fatalf("bad reply magic % x", h)
	return reply{}
}

// expectClosed asserts the server hung up.
func (c *tclient) expectClosed() {
	c.t.Helper()
	c.c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.br.ReadByte(); err != io.EOF {
		c.t.Fatalf("want EOF, got %v", err)
	}
}
