package nbd

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

var be = binary.BigEndian

// errProtocol marks a client that broke a MUST of the handshake; the spec
// lets us hang up on it, and there is no way to answer.
var errProtocol = errors.New("nbd: protocol violation")

// session is what the handshake agreed on for the transmission phase.
type session struct {
	exp        *Export
	size       uint64 // what the client was told: its bounds
	structured bool
	meta       bool // base:allocation selected
	// followSize checks bounds against the backend's current size, not
	// the size at connect: the kernel learns of a resize through netlink
	// and then sends I/O in the new space on its old connections.
	followSize bool
	kernel     bool // served by ServeNegotiated: the reader is nbd.ko
}

type negotiator struct {
	s          *Server
	br         *bufio.Reader
	bw         *bufio.Writer
	noZeroes   bool
	structured bool
	meta       bool
	metaExport string
	data       []byte
}

// negotiate runs the fixed-newstyle handshake. It returns (nil, nil) when
// the client ended it cleanly (NBD_OPT_ABORT).
func (s *Server) negotiate(br *bufio.Reader, w io.Writer) (*session, error) {
	n := &negotiator{s: s, br: br, bw: bufio.NewWriterSize(w, 4096)}
	var hello [18]byte
	be.PutUint64(hello[0:], magicInit)
	be.PutUint64(hello[8:], magicOpt)
	be.PutUint16(hello[16:], hsFixedNewstyle|hsNoZeroes)
	n.bw.Write(hello[:])
	if err := n.bw.Flush(); err != nil {
		return nil, err
	}
	var cf [4]byte
	if _, err := io.ReadFull(br, cf[:]); err != nil {
		return nil, err
	}
	flags := be.Uint32(cf[:])
	if flags&^(clientFixedNewstyle|clientNoZeroes) != 0 {
		return nil, fmt.Errorf("%w: unknown client flags %#x", errProtocol, flags)
	}
	n.noZeroes = flags&clientNoZeroes != 0
	for {
		sess, done, err := n.option()
		if err != nil || done {
			return sess, err
		}
	}
}

// option reads and answers one option. done reports the end of the
// handshake, with a session (transmission) or without (abort).
func (n *negotiator) option() (sess *session, done bool, err error) {
	var h [handshakeHeaderSize]byte
	if _, err := io.ReadFull(n.br, h[:]); err != nil {
		return nil, true, err
	}
	if m := be.Uint64(h[0:]); m != magicOpt {
		return nil, true, fmt.Errorf("%w: bad option magic %#x", errProtocol, m)
	}
	opt := be.Uint32(h[8:])
	length := be.Uint32(h[12:])
	if length > maxOptionData {
		// EXPORT_NAME cannot carry an error; a huge option is a DoS.
		if opt == optExportName || length > maxDiscardOption {
			return nil, true, fmt.Errorf("%w: option %d with %d bytes of data", errProtocol, opt, length)
		}
		if _, err := io.CopyN(io.Discard, n.br, int64(length)); err != nil {
			return nil, true, err
		}
		return nil, false, n.reply(opt, repErrTooBig, []byte("option data too large"))
	}
	if cap(n.data) < int(length) {
		n.data = make([]byte, length)
	}
	data := n.data[:length]
	if _, err := io.ReadFull(n.br, data); err != nil {
		return nil, true, err
	}
	if opt != optAbort && n.s.isClosing() {
		if opt == optExportName {
			return nil, true, ErrServerClosed
		}
		return nil, false, n.reply(opt, repErrShutdown, []byte("server is shutting down"))
	}
	switch opt {
	case optExportName:
		return n.exportName(string(data))
	case optAbort:
		n.reply(opt, repAck, nil) // best effort: the client may be gone already
		return nil, true, nil
	case optList:
		return nil, false, n.list(data)
	case optStartTLS:
		if len(data) != 0 {
			return nil, false, n.reply(opt, repErrInvalid, []byte("STARTTLS takes no data"))
		}
		return nil, false, n.reply(opt, repErrPolicy, []byte("TLS is not configured on this server"))
	case optInfo, optGo:
		return n.info(opt, data)
	case optStructuredReply:
		if len(data) != 0 {
			return nil, false, n.reply(opt, repErrInvalid, []byte("STRUCTURED_REPLY takes no data"))
		}
		n.structured = true
		return nil, false, n.reply(opt, repAck, nil)
	case optListMetaContext, optSetMetaContext:
		return nil, false, n.metaContext(opt, data)
	}
	return nil, false, n.reply(opt, repErrUnsup, []byte("option not supported"))
}

func (n *negotiator) reply(opt, typ uint32, data []byte) error {
	n.replyNoFlush(opt, typ, data)
	return n.bw.Flush()
}

func (n *negotiator) replyNoFlush(opt, typ uint32, data []byte) {
	var h [20]byte
	be.PutUint64(h[0:], magicOptReply)
	be.PutUint32(h[8:], opt)
	be.PutUint32(h[12:], typ)
	be.PutUint32(h[16:], uint32(len(data)))
	n.bw.Write(h[:])
	n.bw.Write(data)
}

func (n *negotiator) exportName(name string) (*session, bool, error) {
	exp := n.s.export(name)
	if exp == nil {
		return nil, true, fmt.Errorf("%w: unknown export %q requested with EXPORT_NAME", errProtocol, name)
	}
	size := exp.Backend.Size()
	var b [10 + 124]byte
	be.PutUint64(b[0:], size)
	be.PutUint16(b[8:], uint16(exp.Flags(n.structured)))
	end := len(b)
	if n.noZeroes {
		end = 10
	}
	n.bw.Write(b[:end])
	return n.session(exp, size), true, n.bw.Flush()
}

func (n *negotiator) session(exp *Export, size uint64) *session {
	return &session{exp: exp, size: size, structured: n.structured, meta: n.meta && n.metaExport == exp.Name}
}

func (n *negotiator) list(data []byte) error {
	if len(data) != 0 {
		return n.reply(optList, repErrInvalid, []byte("LIST takes no data"))
	}
	for _, e := range n.s.exportList() {
		d := be.AppendUint32(nil, uint32(len(e.Name)))
		d = append(d, e.Name...)
		d = append(d, e.Description...)
		n.replyNoFlush(optList, repServer, d)
	}
	return n.reply(optList, repAck, nil)
}

// info answers INFO and GO: both describe an export, GO then enters
// transmission with it.
func (n *negotiator) info(opt uint32, data []byte) (*session, bool, error) {
	invalid := func(msg string) (*session, bool, error) {
		return nil, false, n.reply(opt, repErrInvalid, []byte(msg))
	}
	if len(data) < 6 {
		return invalid("option data too short")
	}
	nameLen := be.Uint32(data)
	if nameLen > maxStringLen || uint64(nameLen)+6 > uint64(len(data)) {
		return invalid("bad export name length")
	}
	name := string(data[4 : 4+nameLen])
	rest := data[4+nameLen:]
	nreq := int(be.Uint16(rest))
	if len(rest) != 2+2*nreq {
		return invalid("bad information request count")
	}
	exp := n.s.export(name)
	if exp == nil {
		return nil, false, n.reply(opt, repErrUnknown, fmt.Appendf(nil, "no export named %q", name))
	}
	var wantName, wantDesc bool
	for i := range nreq {
		switch be.Uint16(rest[2+2*i:]) {
		case infoName:
			wantName = true
		case infoDescription:
			wantDesc = true
		}
	}
	size := exp.Backend.Size()
	var b [18]byte
	be.PutUint16(b[0:], infoExport)
	be.PutUint64(b[2:], size)
	be.PutUint16(b[10:], uint16(exp.Flags(n.structured)))
	n.replyNoFlush(opt, repInfo, b[:12])
	// Always sent: a client that did not ask may ignore it, one that
	// did not know to ask still learns our 32 MiB limit.
	be.PutUint16(b[0:], infoBlockSize)
	be.PutUint32(b[2:], 1)
	be.PutUint32(b[6:], PreferredBlockSize)
	be.PutUint32(b[10:], MaxPayload)
	n.replyNoFlush(opt, repInfo, b[:14])
	if wantName {
		n.replyNoFlush(opt, repInfo, append([]byte{0, infoName}, exp.Name...))
	}
	if wantDesc && exp.Description != "" {
		n.replyNoFlush(opt, repInfo, append([]byte{0, infoDescription}, exp.Description...))
	}
	if err := n.reply(opt, repAck, nil); err != nil || opt == optInfo {
		return nil, false, err
	}
	return n.session(exp, size), true, nil
}

// metaContext answers LIST_META_CONTEXT and SET_META_CONTEXT. The only
// context is base:allocation; queries for other namespaces match nothing.
func (n *negotiator) metaContext(opt uint32, data []byte) error {
	invalid := func(msg string) error { return n.reply(opt, repErrInvalid, []byte(msg)) }
	if !n.structured {
		return invalid("structured replies must be negotiated first")
	}
	name, rest, ok := cutString(data)
	if !ok || len(rest) < 4 {
		return invalid("bad export name")
	}
	nq := be.Uint32(rest)
	rest = rest[4:]
	queries := make([]string, 0, min(nq, 16))
	for range nq {
		var q string
		if q, rest, ok = cutString(rest); !ok {
			return invalid("bad query")
		}
		queries = append(queries, q)
	}
	if len(rest) != 0 {
		return invalid("trailing data after queries")
	}
	if n.s.export(name) == nil {
		return n.reply(opt, repErrUnknown, fmt.Appendf(nil, "no export named %q", name))
	}
	match := len(queries) == 0 && opt == optListMetaContext
	for _, q := range queries {
		if q == metaBaseAllocation || (opt == optListMetaContext && q == "base:") {
			match = true
		}
	}
	if opt == optSetMetaContext {
		n.meta, n.metaExport = match, name
	}
	if match {
		var id uint32
		if opt == optSetMetaContext {
			id = metaBaseAllocID
		}
		d := be.AppendUint32(nil, id)
		n.replyNoFlush(opt, repMetaContext, append(d, metaBaseAllocation...))
	}
	return n.reply(opt, repAck, nil)
}

// cutString splits a 32-bit length-prefixed string off b.
func cutString(b []byte) (s string, rest []byte, ok bool) {
	if len(b) < 4 {
		return "", nil, false
	}
	l := be.Uint32(b)
	if l > maxStringLen || uint64(l) > uint64(len(b)-4) {
		return "", nil, false
	}
	return string(b[4 : 4+l]), b[4+l:], true
}
