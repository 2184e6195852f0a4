package nbd

import (
	"time"

	"golang.org/x/sys/unix"
)

// Zero-copy READ replies. A large READ payload is vmspliced into a pipe
// and spliced from there into the unix socket: the socket then holds
// references to our pages instead of a copy, which saves one memory copy
// per byte read (at 1 MiB reads, the sendmsg copy was a fifth of the
// server's CPU time). The price is that the buffer must not be reused
// until the peer has consumed those bytes. We know that from SIOCOUTQ:
// on a unix socket it counts, at their true size, every buffer we sent
// that the peer has not yet freed, and a unix stream delivers in order.
// So a payload whose last byte was followed by `after` more bytes sent
// is certainly consumed once SIOCOUTQ ≤ after: if any piece of it were
// still queued, that piece and everything after it would count more.
//
// Replies a backend sends itself (direct.go) are not counted in sent:
// they only make "after" larger than we know, so a payload is reclaimed
// no earlier than it would be without them.
//
// TCP is never spliced: on loopback the receiver's queue holds clones of
// our buffers that outlive the acknowledgement SIOCOUTQ reports.

// zeroCopyMin is the smallest READ payload worth two extra syscalls.
const zeroCopyMin = 64 << 10

// ZeroCopy selects which connections splice READ payloads.
type ZeroCopy int

const (
	// ZeroCopyKernel, the default, splices on ServeNegotiated unix
	// sockets only: their reader is the kernel's nbd driver, which
	// copies what it receives into its own pages.
	ZeroCopyKernel ZeroCopy = iota
	// ZeroCopyOff always copies.
	ZeroCopyOff
	// ZeroCopyUnix splices on every unix socket. Only for clients that
	// read with read(2)/recv(2), as libnbd, qemu and nbd-client do: one
	// that moved our bytes on with splice(2) would keep references to
	// our pages after SIOCOUTQ said they were consumed, and could see
	// them change.
	ZeroCopyUnix
)

// spliceState is the zero-copy part of a connection's send state.
type spliceState struct {
	on     bool
	pr, pw int    // the pipe, once needed
	pipe   int    // its capacity; 0 until it is opened
	sent   uint64 // bytes written to the socket so far, by any call
	parked []parked
}

// spliceReply is a reply whose payload, iov[at:at+n], goes out by splice.
type spliceReply struct {
	r     *Request
	at, n int
}

// parked is a spliced payload waiting for the peer to consume it: our
// buffer or a backend's loan.
type parked struct {
	buf  *payload
	loan Loan
	end  uint64 // sent, just after its last byte
}

// zeroCopyFor says whether a connection splices: a unix socket (never
// TCP, see above) that the mode allows.
func zeroCopyFor(mode ZeroCopy, kernel, unixSocket bool) bool {
	return unixSocket && (mode == ZeroCopyUnix || mode == ZeroCopyKernel && kernel)
}

// spliceable reports whether r's reply payload may go out by reference.
func (z *spliceState) spliceable(r *Request) bool {
	return z.on && r.cmd == cmdRead && r.err == nil && r.Length >= zeroCopyMin &&
		(r.loan != nil || r.buf != nil && r.buf.mapped)
}

// splice writes segs to the socket fd by page reference. It blocks until
// all of them are in the socket (or the socket fails).
func (z *spliceState) splice(fd int, segs [][]byte) error {
	if z.pipe == 0 {
		if err := z.openPipe(); err != nil {
			return err
		}
	}
	var iov [1]unix.Iovec
	for len(segs) > 0 {
		b := segs[0]
		if len(b) == 0 {
			segs = segs[1:]
			continue
		}
		n := min(len(b), z.pipe)
		iov[0].Base = &b[0]
		iov[0].SetLen(n)
		in, err := unix.Vmsplice(z.pw, iov[:], 0)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		for left := in; left > 0; {
			out, err := unix.Splice(z.pr, nil, fd, nil, left, unix.SPLICE_F_MOVE)
			if err == unix.EINTR {
				continue
			}
			if err != nil {
				return err // the pipe keeps the rest; the connection is done
			}
			if out == 0 {
				return unix.EPIPE
			}
			left -= int(out)
			z.sent += uint64(out)
		}
		segs[0] = b[in:]
	}
	return nil
}

func (z *spliceState) openPipe() error {
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
		return err
	}
	z.pr, z.pw = p[0], p[1]
	// A pipe as large as the payloads saves syscalls; the default (64
	// KiB) is what an unprivileged process gets if it may not grow one.
	z.pipe = 64 << 10
	if n, err := unix.FcntlInt(uintptr(z.pw), unix.F_SETPIPE_SZ, 1<<20); err == nil {
		z.pipe = n
	}
	return nil
}

// park keeps r's payload from reuse until the peer has consumed it.
func (z *spliceState) park(r *Request) {
	if r.loan != nil {
		z.parked = append(z.parked, parked{loan: r.loan, end: z.sent})
		r.loan = nil
		return // r.Data, unused, goes back to the pool as usual
	}
	z.parked = append(z.parked, parked{buf: r.buf, end: z.sent})
	r.buf, r.Data = nil, nil
}

// reclaim returns to the pool every parked payload the peer has consumed.
func (z *spliceState) reclaim(fd int, pool *bufPool) {
	if len(z.parked) == 0 {
		return
	}
	q, err := unix.IoctlGetInt(fd, unix.SIOCOUTQ)
	if err != nil {
		return // keep them: the collector unmaps them with the connection
	}
	n := 0
	for _, p := range z.parked {
		if uint64(q) > z.sent-p.end {
			break
		}
		if p.loan != nil {
			p.loan.Release()
		} else {
			pool.put(p.buf)
		}
		n++
	}
	if n > 0 {
		k := copy(z.parked, z.parked[n:])
		clear(z.parked[k:])
		z.parked = z.parked[:k]
	}
}

// loanDrainWait bounds how long a closing connection waits for its peer
// to consume (or drop) lent payloads it was sent by reference.
const loanDrainWait = 5 * time.Second

// close drops the pipe; it returns how many loans it had to leak. Parked
// buffers of ours are left to the collector, whose cleanup unmaps them:
// safe even while the peer still reads them. A loan is the backend's
// memory, reused once released, so it is released only when the peer has
// consumed it or gone away (its queue is then purged): close waits for
// that, and a loan still unread after loanDrainWait is never released —
// leaked rather than reused under the peer.
func (z *spliceState) close(fd int, pool *bufPool) (leaked int) {
	deadline := time.Now().Add(loanDrainWait)
	for {
		z.reclaim(fd, pool)
		leaked = 0
		for _, p := range z.parked {
			if p.loan != nil {
				leaked++
			}
		}
		if leaked == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	if z.pipe > 0 {
		unix.Close(z.pr)
		unix.Close(z.pw)
		z.pipe = 0
	}
	clear(z.parked)
	z.parked = nil
	return leaked
}
