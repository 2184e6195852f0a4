package nbd

import (
	"errors"
	"sync/atomic"
	"syscall"
)

// Op is the operation a Request asks of a Backend. The values are the NBD
// command numbers so that no translation table sits on the hot path.
type Op uint16

const (
	OpRead        Op = cmdRead
	OpWrite       Op = cmdWrite
	OpFlush       Op = cmdFlush
	OpTrim        Op = cmdTrim
	OpCache       Op = cmdCache
	OpWriteZeroes Op = cmdWriteZeroes
	OpBlockStatus Op = cmdBlockStatus
)

func (o Op) String() string {
	switch o {
	case OpRead:
		return "read"
	case OpWrite:
		return "write"
	case OpFlush:
		return "flush"
	case OpTrim:
		return "trim"
	case OpCache:
		return "cache"
	case OpWriteZeroes:
		return "write-zeroes"
	case OpBlockStatus:
		return "block-status"
	}
	return "unknown"
}

// ReqFlags modify a Request. Only flags the backend advertised a
// capability for are ever set.
type ReqFlags uint16

const (
	// ReqFUA: the write must be durable before the request completes.
	ReqFUA ReqFlags = cmdFlagFUA
	// ReqNoHole: WRITE_ZEROES must leave the range allocated.
	ReqNoHole ReqFlags = cmdFlagNoHole
	// ReqFastZero: fail WRITE_ZEROES with ErrNotSupported rather than
	// fall back to something slower than writing would be.
	ReqFastZero ReqFlags = cmdFlagFastZero
	// ReqOne: BLOCK_STATUS needs only the first extent.
	ReqOne ReqFlags = cmdFlagReqOne
)

// Caps is what a backend can do; the server advertises exactly these and
// refuses commands outside them, so backends never see an op they lack.
type Caps uint32

const (
	CapFlush       Caps = 1 << iota // durable flush
	CapFUA                          // per-request FUA (native or emulated by the backend)
	CapTrim                         // discard
	CapZeroes                       // write-zeroes (honours ReqNoHole)
	CapFastZero                     // write-zeroes can fail fast with ErrNotSupported
	CapCache                        // prefetch hint
	CapBlockStatus                  // allocation status (base:allocation)
	CapMultiConn                    // one cache shared by every connection
	CapReadOnly                     // refuses writes
	CapRotational                   // seek-sensitive medium
)

// Extent is one run of base:allocation status returned by BLOCK_STATUS.
type Extent struct {
	Length uint32
	Flags  uint32 // StateHole | StateZero
}

// Backend serves block I/O for one export. It is built for asynchronous
// engines (librbd aio, io_uring): Submit hands a request over and returns
// at once; the backend later calls r.Complete exactly once, from any
// goroutine (or from within Submit). Until then the backend owns r and
// r.Data; afterwards it must not touch either.
//
// One Backend instance is shared by every connection to its export, which
// is what makes CAN_MULTI_CONN honest: a flush submitted on any connection
// covers writes completed on all of them.
type Backend interface {
	Size() uint64
	Caps() Caps
	Submit(r *Request)
}

// Request is one I/O in flight. The server owns and recycles it; backends
// read the public fields and fill Data (reads) or Extents (block status).
type Request struct {
	Op     Op
	Flags  ReqFlags
	Offset uint64
	Length uint32
	// Data holds Length bytes: the destination of a read, the source of a
	// write; nil for other ops. Pooled memory, valid until Complete. A
	// READ may instead be answered with a Loan (see Lend).
	Data []byte
	// Extents is appended to by BLOCK_STATUS; starts empty with capacity.
	Extents []Extent

	cookie uint64
	cmd    uint16 // command as received (DISC and unknown ones never reach a backend)
	cflags uint16 // command flags as received
	err    error
	owner  completer
	buf    *payload
	loan   Loan // read data lent by the backend, instead of Data
	held   int  // payload bytes reserved against the connection's budget
	// For the slow-request watchdog (slow.go), under the conn's lock.
	state uint8
	slow  bool
	stale bool // marked on the export's staleGate
	// gated: held by the staleGate, not yet submitted. Never marked stale
	// meanwhile: two held copies of one write (the kernel retried twice)
	// would each wait for the other.
	gated bool
	born  uint32 // watchdog tick when read
	// payloadIn: the whole request is read, a WRITE's payload included
	// (set by the reader after it, so a stale mark taken after this is
	// seen holds the payload the gate may compare).
	payloadIn atomic.Bool
	// For Stats: when the header was read and when the backend got it
	// (0: never submitted), on Stats' clock.
	tRead, tSubmit int64
	// inSubmit is set while the reader is inside Backend.Submit(r): a
	// completion then is inline and the reader will send its reply.
	inSubmit atomic.Bool
	hdr      [32]byte // reply header scratch: never allocates per reply
	ext      []byte   // encoded extents scratch
}

type completer interface{ complete(r *Request) }

// Complete finishes the request with err (nil for success). Errors are
// mapped to NBD error codes by ErrnoOf.
func (r *Request) Complete(err error) {
	r.err = err
	r.owner.complete(r)
}

// Batch completes requests without sending their replies until Flush,
// which then sends each connection's replies from the calling goroutine
// with one non-blocking sendmsg (a full socket still goes to the writer
// goroutine). A backend that reaps completions in groups (rbdio's reaper)
// saves a goroutine hand-off per request this way. Flush must follow.
type Batch struct{ conns []*conn }

// Complete is Request.Complete, deferred to Flush.
func (b *Batch) Complete(r *Request, err error) {
	r.err = err
	c, ok := r.owner.(*conn)
	if !ok {
		r.owner.complete(r)
		return
	}
	if c.completeDeferred(r) {
		b.conns = append(b.conns, c)
	}
}

// Flush sends what Complete deferred.
func (b *Batch) Flush() {
	for i, c := range b.conns {
		c.flushDeferred()
		b.conns[i] = nil
	}
	b.conns = b.conns[:0]
}

// Errno is an NBD protocol error code. Backends may return one directly;
// any other error is mapped by ErrnoOf.
type Errno uint32

func (e Errno) Error() string {
	switch e {
	case errPerm:
		return "operation not permitted"
	case errIO:
		return "input/output error"
	case errNoMem:
		return "cannot allocate memory"
	case errInval:
		return "invalid argument"
	case errNoSpc:
		return "no space left on device"
	case errOverflow:
		return "value too large"
	case errNotSup:
		return "operation not supported"
	case errShutdown:
		return "server is shutting down"
	}
	return "nbd error"
}

// The NBD error codes, for backends and tests.
const (
	ErrPerm         Errno = errPerm
	ErrIO           Errno = errIO
	ErrNoMem        Errno = errNoMem
	ErrInvalid      Errno = errInval
	ErrNoSpace      Errno = errNoSpc
	ErrOverflow     Errno = errOverflow
	ErrNotSupported Errno = errNotSup
	ErrShutdown     Errno = errShutdown
)

// ErrnoOf maps an error to the NBD code a client sees. Anything unknown is
// EIO: a client must learn that something failed even when we cannot say what.
func ErrnoOf(err error) Errno {
	if err == nil {
		return 0
	}
	var e Errno
	if errors.As(err, &e) {
		return e
	}
	var se syscall.Errno
	if errors.As(err, &se) {
		switch se {
		case syscall.EPERM, syscall.EACCES, syscall.EROFS:
			return ErrPerm
		case syscall.ENOMEM:
			return ErrNoMem
		case syscall.EINVAL:
			return ErrInvalid
		case syscall.ENOSPC, syscall.EDQUOT, syscall.EFBIG:
			return ErrNoSpace
		case syscall.EOVERFLOW:
			return ErrOverflow
		case syscall.EOPNOTSUPP:
			return ErrNotSupported
		case syscall.ESHUTDOWN:
			return ErrShutdown
		}
	}
	return ErrIO
}

// Err is the error the request completed with.
func (r *Request) Err() error { return r.err }

// Go submits r to b and calls done(r), on the completing goroutine, when
// it finishes: for callers outside a connection (tools, tests, benches).
func Go(b Backend, r *Request, done func(*Request)) {
	r.owner = doneFunc(done)
	b.Submit(r)
}

type doneFunc func(*Request)

func (f doneFunc) complete(r *Request) { f(r) }

// Do submits one request and waits for it: for control paths (final
// flush on shutdown, tests), never for the data path.
func Do(b Backend, r *Request) error {
	done := make(chan struct{})
	Go(b, r, func(*Request) { close(done) })
	<-done
	return r.err
}

// Flush asks b to make every completed write durable; a no-op for
// backends without CapFlush.
func Flush(b Backend) error {
	if b.Caps()&CapFlush == 0 {
		return nil
	}
	return Do(b, &Request{Op: OpFlush})
}
