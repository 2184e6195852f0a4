package nbd

// appendReply encodes r's reply into r's own scratch space and appends the
// pieces (header, then payload by reference: no copy) to iov. A READ with
// data is one header then the payload's pieces: encode relies on it.
func (c *conn) appendReply(iov [][]byte, r *Request) [][]byte {
	r.checkLoan()
	e := ErrnoOf(r.err)
	if !c.structured || (e == 0 && r.cmd != cmdRead && r.cmd != cmdBlockStatus) {
		// Simple replies are also allowed with structured replies on,
		// for anything but READ that carries no payload.
		iov = append(iov, putSimpleReply(r.hdr[:], e, r.cookie))
		if e == 0 && r.cmd == cmdRead && r.Length > 0 {
			iov = r.appendPayload(iov)
		}
		return iov
	}
	if e != 0 {
		// An error chunk carries a message a human can read.
		msg := r.ext[:0]
		msg = append(msg, r.err.Error()...)
		if len(msg) > 1024 {
			msg = msg[:1024]
		}
		r.ext = msg
		h := r.hdr[:structuredHeaderSize+6]
		putChunkHeader(h, replyTypeError, r.cookie, 6+len(msg))
		be.PutUint32(h[20:], uint32(e))
		be.PutUint16(h[24:], uint16(len(msg)))
		return append(iov, h, msg)
	}
	if r.cmd == cmdBlockStatus {
		c.encodeExtents(r)
		h := r.hdr[:structuredHeaderSize]
		putChunkHeader(h, replyTypeBlockStatus, r.cookie, len(r.ext))
		return append(iov, h, r.ext)
	}
	// READ: one OFFSET_DATA chunk, so DF is always honoured.
	if r.Length == 0 {
		h := r.hdr[:structuredHeaderSize]
		putChunkHeader(h, replyTypeNone, r.cookie, 0)
		return append(iov, h)
	}
	h := r.hdr[:structuredHeaderSize+8]
	putChunkHeader(h, replyTypeOffsetData, r.cookie, 8+int(r.Length))
	be.PutUint64(h[20:], r.Offset)
	return r.appendPayload(append(iov, h))
}

// putSimpleReply encodes a simple reply header at the start of h.
func putSimpleReply(h []byte, e Errno, cookie uint64) []byte {
	h = h[:simpleReplySize]
	be.PutUint32(h[0:], magicSimpleReply)
	be.PutUint32(h[4:], uint32(e))
	be.PutUint64(h[8:], cookie)
	return h
}

func putChunkHeader(h []byte, typ uint16, cookie uint64, length int) {
	be.PutUint32(h[0:], magicStructuredRepl)
	be.PutUint16(h[4:], replyFlagDone)
	be.PutUint16(h[6:], typ)
	be.PutUint64(h[8:], cookie)
	be.PutUint32(h[16:], uint32(length))
}

// encodeExtents turns the backend's extents into a BLOCK_STATUS payload.
// Backends are trusted for content, not for shape: extents are clipped
// to the request, empty ones dropped, neighbours with equal status
// merged, and REQ_ONE and the descriptor cap enforced here.
func (c *conn) encodeExtents(r *Request) {
	b := be.AppendUint32(r.ext[:0], metaBaseAllocID)
	left := r.Length
	n := 0
	var last uint32
	for _, x := range r.Extents {
		if x.Length == 0 || left == 0 {
			continue
		}
		l := min(x.Length, left)
		left -= l
		f := x.Flags & (StateHole | StateZero)
		if n > 0 && f == last {
			i := len(b) - 8
			be.PutUint32(b[i:], be.Uint32(b[i:])+l)
			continue
		}
		if n > 0 && (r.Flags&ReqOne != 0 || n >= maxExtentsRe) {
			break
		}
		b = be.AppendUint32(b, l)
		b = be.AppendUint32(b, f)
		last = f
		n++
	}
	if n == 0 {
		// Spec: at least one descriptor; status 0 is always safe.
		b = be.AppendUint32(b, r.Length)
		b = be.AppendUint32(b, 0)
	}
	r.ext = b
}
