package nbd

// Lent read data. An engine that already holds a READ's bytes in memory of
// its own (librbd returns them in the buffers the messenger received them
// into) would otherwise copy them into r.Data only for the server to send
// them on. Lending them instead saves that copy; with zero-copy replies
// the socket then references the engine's memory directly. The server
// releases a loan once nothing can read it any more: after the reply was
// written, or, when spliced, once the peer has consumed it.

// Loan is read data a backend lends in place of filling r.Data.
type Loan interface {
	// Segments are the data, in order; their lengths add up to the
	// request's Length. They must stay unchanged until Release.
	Segments() [][]byte
	// Release is called exactly once, from any goroutine.
	Release()
}

// CanLend reports whether r accepts a Loan: READs served on a connection
// do; requests of callers outside one (Go, Do) do not.
func (r *Request) CanLend() bool {
	_, onConn := r.owner.(*conn)
	return onConn && r.cmd == cmdRead
}

// Lend makes l the data of r, a READ for which CanLend holds, in place of
// r.Data; call it before Complete. The server owns l from then on, also
// if the request fails.
func (r *Request) Lend(l Loan) {
	if !r.CanLend() {
		panic("nbd: Lend on a request that does not take loans")
	}
	r.loan = l
}

// appendPayload appends r's read data to iov: the loan's segments, or Data.
func (r *Request) appendPayload(iov [][]byte) [][]byte {
	if r.loan == nil {
		return append(iov, r.Data)
	}
	for _, s := range r.loan.Segments() {
		if len(s) > 0 {
			iov = append(iov, s)
		}
	}
	return iov
}

// checkLoan fails r if its loan does not hold exactly Length bytes: a
// reply must carry what its header announces.
func (r *Request) checkLoan() {
	if r.loan == nil || r.err != nil {
		return
	}
	n := 0
	for _, s := range r.loan.Segments() {
		n += len(s)
	}
	if n != int(r.Length) {
		r.err = ErrIO
	}
}
