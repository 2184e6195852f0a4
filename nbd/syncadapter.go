package nbd

import (
	"io"
	"sync"
)

// Device is a synchronous block store: memory, a file, anything with
// positioned reads and writes. Inline and NewPool turn one into a Backend.
// Optional abilities are further interfaces (Flusher, Trimmer, Zeroer,
// Cacher, BlockStatuser, FUAWriter, ReadOnlyer); the adapter advertises a
// capability only when the device implements it.
type Device interface {
	io.ReaderAt
	io.WriterAt
	Size() uint64
}

// Flusher makes completed writes durable.
type Flusher interface{ Flush() error }

// FUAWriter writes durably in one step (pwritev2 RWF_DSYNC); without it the
// adapter emulates FUA as write + Flush.
type FUAWriter interface {
	WriteAtFUA(p []byte, off int64) error
}

// Trimmer discards a range; reads of it are undefined afterwards.
type Trimmer interface{ Trim(off, length int64) error }

// Zeroer makes a range read as zeroes. noHole forbids deallocation; fast
// asks it to fail with ErrNotSupported rather than write zeroes slowly.
type Zeroer interface {
	Zero(off, length int64, noHole, fast bool) error
}

// Cacher prefetches a range.
type Cacher interface{ Cache(off, length int64) error }

// BlockStatuser appends the allocation status of [off, off+length) to dst.
// It may cover less than length, but at least one byte.
type BlockStatuser interface {
	BlockStatus(off, length int64, dst []Extent) ([]Extent, error)
}

// ReadOnlyer reports a device that refuses writes.
type ReadOnlyer interface{ ReadOnly() bool }

// MultiConner lets a device deny CAN_MULTI_CONN (a device with a private
// per-connection cache would). Devices without it are assumed shared.
type MultiConner interface{ MultiConn() bool }

// syncBackend runs a Device's operations; embedding it in inline or pool
// only changes on which goroutine run executes.
type syncBackend struct {
	dev  Device
	caps Caps
	fl   Flusher
	fua  FUAWriter
	tr   Trimmer
	zr   Zeroer
	ca   Cacher
	bs   BlockStatuser
}

func newSync(dev Device) syncBackend {
	s := syncBackend{dev: dev, caps: CapMultiConn}
	if m, ok := dev.(MultiConner); ok && !m.MultiConn() {
		s.caps &^= CapMultiConn
	}
	if ro, ok := dev.(ReadOnlyer); ok && ro.ReadOnly() {
		s.caps |= CapReadOnly
	}
	if f, ok := dev.(Flusher); ok {
		s.fl = f
		s.caps |= CapFlush | CapFUA
	}
	if f, ok := dev.(FUAWriter); ok {
		s.fua = f
		s.caps |= CapFUA
	}
	if t, ok := dev.(Trimmer); ok {
		s.tr = t
		s.caps |= CapTrim
	}
	// Zeroes are always possible: without a Zeroer they are written out,
	// which is why fast zero is only advertised with one.
	s.caps |= CapZeroes
	if z, ok := dev.(Zeroer); ok {
		s.zr = z
		s.caps |= CapFastZero
	}
	if c, ok := dev.(Cacher); ok {
		s.ca = c
		s.caps |= CapCache
	}
	if b, ok := dev.(BlockStatuser); ok {
		s.bs = b
		s.caps |= CapBlockStatus
	}
	return s
}

func (s *syncBackend) Size() uint64 { return s.dev.Size() }
func (s *syncBackend) Caps() Caps   { return s.caps }

func (s *syncBackend) run(r *Request) {
	off := int64(r.Offset)
	n := int64(r.Length)
	var err error
	switch r.Op {
	case OpRead:
		_, err = s.dev.ReadAt(r.Data, off)
	case OpWrite:
		if r.Flags&ReqFUA != 0 && s.fua != nil {
			err = s.fua.WriteAtFUA(r.Data, off)
			break
		}
		if _, err = s.dev.WriteAt(r.Data, off); err == nil {
			err = s.fuaFlush(r)
		}
	case OpFlush:
		if s.fl != nil {
			err = s.fl.Flush()
		}
	case OpTrim:
		if err = s.tr.Trim(off, n); err == nil {
			err = s.fuaFlush(r)
		}
	case OpWriteZeroes:
		if s.zr != nil {
			err = s.zr.Zero(off, n, r.Flags&ReqNoHole != 0, r.Flags&ReqFastZero != 0)
		} else if r.Flags&ReqFastZero != 0 {
			err = ErrNotSupported
		} else {
			err = WriteZeroes(s.dev, off, n)
		}
		if err == nil {
			err = s.fuaFlush(r)
		}
	case OpCache:
		err = s.ca.Cache(off, n)
	case OpBlockStatus:
		r.Extents, err = s.bs.BlockStatus(off, n, r.Extents)
	default:
		err = ErrInvalid
	}
	r.Complete(err)
}

func (s *syncBackend) fuaFlush(r *Request) error {
	if r.Flags&ReqFUA != 0 && s.fl != nil {
		return s.fl.Flush()
	}
	return nil
}

var zeroPage [64 << 10]byte // read-only source for emulated write-zeroes

// WriteZeroes writes n zero bytes at off: the fallback for devices that
// cannot zero a range natively.
func WriteZeroes(w io.WriterAt, off, n int64) error {
	for n > 0 {
		c := min(n, int64(len(zeroPage)))
		if _, err := w.WriteAt(zeroPage[:c], off); err != nil {
			return err
		}
		off += c
		n -= c
	}
	return nil
}

// Inline runs each operation on the submitting goroutine. Right for
// devices whose operations never block (memory): no hand-off at all.
func Inline(dev Device) Backend {
	s := newSync(dev)
	return &inline{s}
}

type inline struct{ syncBackend }

func (b *inline) Submit(r *Request) { b.run(r) }

// Pool runs a Device's blocking operations on a fixed set of worker
// goroutines, so that a slow request never holds up the connection's
// reader and the number of threads stuck in syscalls stays bounded.
type Pool struct {
	syncBackend
	ch          chan *Request
	wg          sync.WaitGroup
	once        sync.Once
	inlineBelow uint32
}

// NewPool starts workers goroutines serving dev. Close stops them.
func NewPool(dev Device, workers int) *Pool { return NewHybrid(dev, workers, 0) }

// NewHybrid is a Pool that runs requests shorter than inlineBelow bytes
// on the submitting goroutine. For a device that never blocks (memory) a
// small copy is cheaper than a hand-off, while a large one is better done
// beside the connection's reader, which meanwhile takes in the next
// payload from the socket.
func NewHybrid(dev Device, workers int, inlineBelow uint32) *Pool {
	if workers < 1 {
		workers = 1
	}
	p := &Pool{syncBackend: newSync(dev), ch: make(chan *Request, 4*workers), inlineBelow: inlineBelow}
	p.wg.Add(workers)
	for range workers {
		go p.work()
	}
	return p
}

func (p *Pool) work() {
	defer p.wg.Done()
	for r := range p.ch {
		p.run(r)
	}
}

// Submit queues r; it blocks only when every worker is busy and the queue
// is full, which is the back-pressure we want on the reader.
func (p *Pool) Submit(r *Request) {
	if r.Length < p.inlineBelow {
		p.run(r)
		return
	}
	p.ch <- r
}

// Close waits for queued requests to finish and stops the workers. No
// Submit may follow.
func (p *Pool) Close() error {
	p.once.Do(func() { close(p.ch) })
	p.wg.Wait()
	return nil
}
