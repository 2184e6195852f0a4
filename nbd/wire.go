package nbd

import (
	"bufio"
	"bytes"
	"io"
	"net"
	"os"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// wire is one connection's transport as the server tracks it.
//
// The handshake runs on the net.Conn, with deadlines. For transmission
// the socket is detached from Go's netpoller: duplicated in blocking mode
// and the net.Conn closed. A connection has exactly two goroutines, each
// in one socket call at a time, so blocking calls cost one thread each,
// and the kernel wakes them directly. Left in the poller, the socket's
// edge-triggered events would wake epoll_wait in the scheduler for every
// segment that arrives: a quarter of the CPU time at 100k requests/s.
// Interruption (Shutdown, a dead client) goes through shutdown(2), which
// wakes blocked callers; the fd is closed only under the server's lock,
// so shutdown(2) never hits a recycled descriptor.
type wire struct {
	nc net.Conn // handshake, and transmission when nc is no socket (tests)
	f  *os.File // the detached socket, or nil
	fd int      // f's descriptor, or -1
	// unix: fd is an AF_UNIX socket (its send buffer is ours to size,
	// and it may splice).
	unix bool
	// rest holds what the handshake read ahead, read before the socket;
	// nil if nothing was.
	rest *bytes.Reader
	// handed: the socket now belongs to another server (Paused.Release):
	// it must never be shut down from here, only our descriptor closed.
	// untrack closes released once it has closed it.
	handed   atomic.Bool
	released chan struct{}
}

func newWire(nc net.Conn) *wire { return &wire{nc: nc, fd: -1} }

// detach moves w to a blocking descriptor of its own (called with the
// server's lock held). Bytes the handshake reader already buffered are
// kept in front of the returned reader. With idleAfter > 0 a read that
// waits that long fails with errIdle (the reader then parks: conn.park).
func (w *wire) detach(br *bufio.Reader, idleAfter time.Duration) io.Reader {
	var rest []byte
	if n := br.Buffered(); n > 0 {
		rest, _ = br.Peek(n)
		rest = bytes.Clone(rest)
	}
	w.nc.SetDeadline(time.Time{})
	fd := -1
	if sc, ok := w.nc.(syscall.Conn); ok {
		if rc, err := sc.SyscallConn(); err == nil {
			rc.Control(func(s uintptr) {
				d, err := unix.FcntlInt(s, unix.F_DUPFD_CLOEXEC, 0)
				if err != nil {
					return
				}
				if unix.SetNonblock(d, false) != nil {
					unix.Close(d)
					return
				}
				fd = d
			})
		}
	}
	var r io.Reader = w.nc
	if fd >= 0 {
		w.nc.Close() // leaves the poller; the duplicate keeps the socket
		w.f, w.fd = os.NewFile(uintptr(fd), "nbd"), fd
		d, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_DOMAIN)
		w.unix = err == nil && d == unix.AF_UNIX
		r = w.f
		if idleAfter > 0 {
			tv := unix.NsecToTimeval(idleAfter.Nanoseconds())
			if unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv) == nil {
				r = fdReader(fd)
			}
		}
	}
	if len(rest) > 0 {
		w.rest = bytes.NewReader(rest)
		r = io.MultiReader(w.rest, r)
	}
	return r
}

// stopReading makes a blocked or future read return EOF while replies can
// still be written.
func (w *wire) stopReading() {
	if w.handed.Load() {
		return
	}
	if w.fd >= 0 {
		unix.Shutdown(w.fd, unix.SHUT_RD)
		return
	}
	if cr, ok := w.nc.(interface{ CloseRead() error }); ok {
		cr.CloseRead()
		return
	}
	w.nc.SetReadDeadline(time.Unix(1, 0))
}

// abort shuts both directions down, waking a reader blocked in the kernel.
func (w *wire) abort() {
	if w.handed.Load() {
		return
	}
	if w.fd >= 0 {
		unix.Shutdown(w.fd, unix.SHUT_RDWR)
		return
	}
	w.nc.Close()
}

// close releases the descriptor (server lock held). It never shuts the
// socket down: a handed-over socket lives on in its new owner's copy.
func (w *wire) close() {
	if w.f != nil {
		w.f.Close()
		w.fd = -1
	}
	w.nc.Close()
}

// DefaultSendBuffer is the SO_SNDBUF we ask for on unix sockets (the
// kernel doubles it). On a unix stream the sender's buffer is the whole
// window: with the usual 208 KiB a 1 MiB reply crosses in five pieces,
// each a sleep and a wake-up on both sides; at 1 MiB reads that was
// three times the context switches of a buffer that holds the reply.
const DefaultSendBuffer = 2 << 20

// SetSendBuffer sizes the send buffer of socket fd. With CAP_NET_ADMIN
// it may exceed net.core.wmem_max (which is 208 KiB on a stock system);
// otherwise it is capped there.
func SetSendBuffer(fd, n int) error {
	if unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_SNDBUFFORCE, n) == nil {
		return nil
	}
	return unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_SNDBUF, n)
}
