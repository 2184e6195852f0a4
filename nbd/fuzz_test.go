package nbd

import (
	"bufio"
	"bytes"
	"io"
	"net"
	"testing"
	"time"
)

// optBytes encodes one client option for seed corpora.
func optBytes(opt uint32, data []byte) []byte {
	b := be.AppendUint64(nil, magicOpt)
	b = be.AppendUint32(b, opt)
	b = be.AppendUint32(b, uint32(len(data)))
	return append(b, data...)
}

func reqBytes(cmd, flags uint16, cookie, off uint64, length uint32, payload []byte) []byte {
	b := be.AppendUint32(nil, magicRequest)
	b = be.AppendUint16(b, flags)
	b = be.AppendUint16(b, cmd)
	b = be.AppendUint64(b, cookie)
	b = be.AppendUint64(b, off)
	b = be.AppendUint32(b, length)
	return append(b, payload...)
}

func FuzzHandshake(f *testing.F) {
	flags := be.AppendUint32(nil, clientFixedNewstyle|clientNoZeroes)
	cat := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	f.Add(cat(flags, optBytes(optExportName, nil)))
	f.Add(cat(flags, optBytes(optList, nil), optBytes(optAbort, nil)))
	f.Add(cat(flags, optBytes(optStructuredReply, nil),
		optBytes(optSetMetaContext, metaData("", metaBaseAllocation)),
		optBytes(optListMetaContext, metaData("", "base:")),
		optBytes(optGo, goData("", infoName, infoDescription, infoBlockSize))))
	f.Add(cat(flags, optBytes(optInfo, goData("disk")), optBytes(optStartTLS, nil), optBytes(77, []byte("?"))))
	f.Add(cat(flags, optBytes(optInfo, []byte{0xff, 0xff, 0xff, 0xff, 0, 0})))
	f.Add(cat(flags, optBytes(optSetMetaContext, []byte{0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff})))
	s := NewServer(Config{})
	s.AddExport(Export{Backend: Inline(newFlat(4096))})
	s.AddExport(Export{Name: "disk", Description: "d", Backend: Inline(newFlat(8192))})
	f.Fuzz(func(t *testing.T, data []byte) {
		sess, err := s.negotiate(bufio.NewReader(bytes.NewReader(data)), io.Discard)
		if sess != nil && (err != nil || sess.exp == nil) {
			t.Fatalf("session %+v with error %v", sess, err)
		}
		if sess != nil && sess.meta && !sess.structured {
			t.Fatal("meta context without structured replies")
		}
	})
}

// streamConn is a net.Conn that reads a fixed byte stream and writes
// into a buffer: transmission fuzzing needs no sockets.
type streamConn struct {
	r io.Reader
	w bytes.Buffer
}

func (c *streamConn) Read(p []byte) (int, error)       { return c.r.Read(p) }
func (c *streamConn) Write(p []byte) (int, error)      { return c.w.Write(p) }
func (c *streamConn) Close() error                     { return nil }
func (c *streamConn) LocalAddr() net.Addr              { return nil }
func (c *streamConn) RemoteAddr() net.Addr             { return nil }
func (c *streamConn) SetDeadline(time.Time) error      { return nil }
func (c *streamConn) SetReadDeadline(time.Time) error  { return nil }
func (c *streamConn) SetWriteDeadline(time.Time) error { return nil }

func FuzzTransmission(f *testing.F) {
	cat := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	f.Add(byte(1), cat(reqBytes(cmdWrite, cmdFlagFUA, 1, 0, 8, []byte("abcdefgh")),
		reqBytes(cmdRead, cmdFlagDF, 2, 0, 8, nil), reqBytes(cmdFlush, 0, 3, 0, 0, nil),
		reqBytes(cmdDisc, 0, 4, 0, 0, nil)))
	f.Add(byte(1), cat(reqBytes(cmdTrim, 0, 1, 0, 4096, nil),
		reqBytes(cmdWriteZeroes, cmdFlagNoHole|cmdFlagFastZero, 2, 512, 1024, nil),
		reqBytes(cmdBlockStatus, cmdFlagReqOne, 3, 0, 65536, nil),
		reqBytes(cmdCache, 0, 4, 0, 65536, nil)))
	f.Add(byte(0), cat(reqBytes(cmdRead, 0, 1, 65536-1, 2, nil),
		reqBytes(cmdWrite, 0, 2, 1<<63, 4, []byte("wxyz")),
		reqBytes(99, 0xffff, 3, 0, 0, nil), reqBytes(cmdRead, 0, 4, 0, MaxPayload+1, nil)))
	f.Add(byte(0), cat(reqBytes(cmdWrite, 0, 1, 0, 100, []byte("short"))))
	f.Add(byte(2), []byte{0x25, 0x60, 0x95, 0x13, 0, 0})
	f.Fuzz(func(t *testing.T, mode byte, data []byte) {
		s := NewServer(Config{MaxInflight: 4, MaxInflightBytes: 1 << 20})
		exp := Export{Backend: Inline(newFlat(65536)), ReadOnly: mode&4 != 0}
		s.AddExport(exp)
		nc := &streamConn{r: bytes.NewReader(data)}
		c := newConn(s, newWire(nc), nc, &session{
			exp: s.export(""), size: 65536, structured: mode&1 != 0, meta: mode&2 != 0})
		c.serve()
		if len(c.free) != len(c.all) || len(c.all) > c.total || c.bytes != 0 || s.pool.InFlight() != 0 {
			t.Fatalf("requests leaked: %d of %d made (at most %d) free, %d bytes held, %d in the budget",
				len(c.free), len(c.all), c.total, c.bytes, s.pool.InFlight())
		}
		checkReplies(t, nc.w.Bytes(), c.structured)
	})
}

// checkReplies walks the reply stream: every message must be well framed.
func checkReplies(t *testing.T, b []byte, structured bool) {
	for len(b) > 0 {
		if len(b) < 4 {
			t.Fatalf("truncated reply magic")
		}
		switch be.Uint32(b) {
		case magicSimpleReply:
			if len(b) < simpleReplySize {
				t.Fatal("truncated simple reply")
			}
			b = b[simpleReplySize:]
			if structured {
				// only READ data follows simple replies, and READ is
				// always structured here: nothing else may follow.
				continue
			}
			// Without structured replies READ data is unframed; stop.
			return
		case magicStructuredRepl:
			if len(b) < structuredHeaderSize {
				t.Fatal("truncated chunk header")
			}
			n := int(be.Uint32(b[16:]))
			if typ := be.Uint16(b[6:]); typ == replyTypeError && n < 6 {
				t.Fatalf("error chunk of %d bytes", n)
			}
			if len(b) < structuredHeaderSize+n {
				t.Fatal("truncated chunk payload")
			}
			b = b[structuredHeaderSize+n:]
		default:
			t.Fatalf("bad reply magic % x", b[:4])
		}
	}
}
