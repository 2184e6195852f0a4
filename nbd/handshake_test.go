package nbd

import (
	"bytes"
	"testing"
)

func flatExport(name string, size int) Export {
	return Export{Name: name, Description: "flat " + name, Backend: Inline(newFlat(size))}
}

func TestHandshakeExportNameZeroes(t *testing.T) {
	s := newTestServer(t, flatExport("", 1<<20))
	for _, noZeroes := range []bool{false, true} {
		c := connect(t, s)
		flags := uint32(clientFixedNewstyle)
		if noZeroes {
			flags |= clientNoZeroes
		}
		c.greet(flags)
		c.sendOpt(optExportName, nil)
		b := c.read(10)
		if size := be.Uint64(b); size != 1<<20 {
			t.Fatalf("size %d", size)
		}
		tf := TransmissionFlags(be.Uint16(b[8:]))
		if tf&FlagHasFlags == 0 || tf&FlagSendDF != 0 {
			t.Fatalf("flags %#x: DF without structured replies", tf)
		}
		if !noZeroes {
			if z := c.read(124); !bytes.Equal(z, make([]byte, 124)) {
				t.Fatal("124 reserved bytes not zero")
			}
		}
		// Transmission works right after: a simple read.
		c.send(cmdRead, 0, 7, 0, 512, nil)
		if r := c.recv(512); r.errno != 0 || r.cookie != 7 || len(r.data) != 512 {
			t.Fatalf("read after EXPORT_NAME: %+v", r)
		}
	}
}

func TestHandshakeRejects(t *testing.T) {
	s := newTestServer(t, flatExport("", 4096))
	t.Run("unknown client flags", func(t *testing.T) {
		c := connect(t, s)
		c.greet(1 << 5)
		c.expectClosed()
	})
	t.Run("bad option magic", func(t *testing.T) {
		c := connect(t, s)
		c.greet(clientFixedNewstyle)
		c.write(make([]byte, 16))
		c.expectClosed()
	})
	t.Run("unknown export by EXPORT_NAME", func(t *testing.T) {
		c := connect(t, s)
		c.greet(clientFixedNewstyle)
		c.sendOpt(optExportName, []byte("nope"))
		c.expectClosed()
	})
	t.Run("option data beyond discard limit", func(t *testing.T) {
		c := connect(t, s)
		c.greet(clientFixedNewstyle)
		b := be.AppendUint64(nil, magicOpt)
		b = be.AppendUint32(b, optInfo)
		c.write(be.AppendUint32(b, 64<<20))
		c.expectClosed()
	})
}

func TestHandshakeOptionErrors(t *testing.T) {
	s := newTestServer(t, flatExport("", 4096), flatExport("b", 8192))
	c := connect(t, s)
	c.greet(clientFixedNewstyle | clientNoZeroes)
	cases := []struct {
		name string
		opt  uint32
		data []byte
		want uint32
	}{
		{"unknown option", 99, []byte("x"), repErrUnsup},
		{"extended headers unsupported", optExtendedHeaders, nil, repErrUnsup},
		{"starttls without tls", optStartTLS, nil, repErrPolicy},
		{"list with data", optList, []byte{1}, repErrInvalid},
		{"structured reply with data", optStructuredReply, []byte{1}, repErrInvalid},
		{"meta context before structured", optListMetaContext, metaData(""), repErrInvalid},
		{"info unknown export", optInfo, goData("zzz"), repErrUnknown},
		{"info truncated", optInfo, []byte{0, 0, 0, 9, 'a'}, repErrInvalid},
		{"info bad request count", optInfo, append(goData("b"), 0), repErrInvalid},
		{"go unknown export", optGo, goData("zzz"), repErrUnknown},
		{"oversized option", optInfo, make([]byte, 100<<10), repErrTooBig},
	}
	for _, tc := range cases {
		rs := c.opt(tc.opt, tc.data)
		if got := rs[len(rs)-1].typ; got != tc.want {
			t.Errorf("%s: reply %#x, want %#x", tc.name, got, tc.want)
		}
	}
	// After all that the session is still usable.
	if size, _ := c.open2("b"); size != 8192 {
		t.Fatalf("GO after errors: size %d", size)
	}
}

// open2 finishes a handshake already greeted.
func (c *tclient) open2(name string) (uint64, TransmissionFlags) {
	var size uint64
	var f TransmissionFlags
	for _, r := range c.opt(optGo, goData(name)) {
		if r.typ == repInfo && be.Uint16(r.data) == infoExport {
			size, f = be.Uint64(r.data[2:]), TransmissionFlags(be.Uint16(r.data[10:]))
		}
	}
	return size, f
}

func TestHandshakeListInfoAbort(t *testing.T) {
	s := newTestServer(t, flatExport("", 4096), flatExport("disk2", 8192))
	c := connect(t, s)
	c.greet(clientFixedNewstyle)
	rs := c.opt(optList, nil)
	if len(rs) != 3 || rs[2].typ != repAck {
		t.Fatalf("LIST: %d replies", len(rs))
	}
	if n := be.Uint32(rs[1].data); string(rs[1].data[4:4+n]) != "disk2" ||
		string(rs[1].data[4+n:]) != "flat disk2" {
		t.Fatalf("LIST entry %q", rs[1].data)
	}
	info := map[uint16][]byte{}
	for _, r := range c.opt(optInfo, goData("disk2", infoName, infoDescription, infoBlockSize)) {
		if r.typ == repInfo {
			info[be.Uint16(r.data)] = r.data[2:]
		}
	}
	if be.Uint64(info[infoExport]) != 8192 {
		t.Fatalf("INFO size %d", be.Uint64(info[infoExport]))
	}
	if string(info[infoName]) != "disk2" || string(info[infoDescription]) != "flat disk2" {
		t.Fatalf("INFO name/description %q %q", info[infoName], info[infoDescription])
	}
	bs := info[infoBlockSize]
	if len(bs) != 12 || be.Uint32(bs) != 1 || be.Uint32(bs[4:]) != 4096 || be.Uint32(bs[8:]) != MaxPayload {
		t.Fatalf("INFO block size % x", bs)
	}
	// INFO does not end the handshake; ABORT does, with an ACK.
	if r := c.opt(optAbort, nil); r[0].typ != repAck {
		t.Fatalf("ABORT reply %#x", r[0].typ)
	}
	c.expectClosed()
}

func TestHandshakeMetaContext(t *testing.T) {
	s := newTestServer(t, flatExport("", 4096))
	c := connect(t, s)
	c.greet(clientFixedNewstyle)
	c.opt(optStructuredReply, nil)
	for _, q := range [][]string{nil, {"base:"}, {metaBaseAllocation}} {
		rs := c.opt(optListMetaContext, metaData("", q...))
		if len(rs) != 2 || rs[0].typ != repMetaContext || string(rs[0].data[4:]) != metaBaseAllocation {
			t.Fatalf("LIST_META_CONTEXT %q: %+v", q, rs)
		}
	}
	// Unknown namespaces select nothing: just the ACK.
	if rs := c.opt(optSetMetaContext, metaData("", "qemu:dirty-bitmap:x")); len(rs) != 1 || rs[0].typ != repAck {
		t.Fatalf("SET unknown: %+v", rs)
	}
	if rs := c.opt(optSetMetaContext, metaData("nope", metaBaseAllocation)); rs[0].typ != repErrUnknown {
		t.Fatalf("SET for unknown export: %#x", rs[0].typ)
	}
	if rs := c.opt(optSetMetaContext, metaData("", "x")[:9]); rs[0].typ != repErrInvalid {
		t.Fatalf("SET truncated: %#x", rs[0].typ)
	}
	// Nothing selected: BLOCK_STATUS is EINVAL.
	c.open2("")
	c.send(cmdBlockStatus, 0, 1, 0, 4096, nil)
	if r := c.recv(0); r.errno != errInval {
		t.Fatalf("BLOCK_STATUS without context: %+v", r)
	}
}
