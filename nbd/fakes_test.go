package nbd

import (
	"context"
	"sync"
	"testing"
	"time"
)

// flatDev is a small, fully featured in-memory Device for tests in this
// package (the real mem backend lives in a package that imports this one).
type flatDev struct {
	mu      sync.Mutex
	b       []byte
	ro      bool
	flushes int
	fuas    int
	err     error // returned by every op when set
}

func newFlat(size int) *flatDev { return &flatDev{b: make([]byte, size)} }

func (d *flatDev) Size() uint64   { return uint64(len(d.b)) }
func (d *flatDev) ReadOnly() bool { return d.ro }
func (d *flatDev) ReadAt(p []byte, off int64) (int, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.err != nil {
		return 0, d.err
	}
	return copy(p, d.b[off:]), nil
}
func (d *flatDev) WriteAt(p []byte, off int64) (int, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.err != nil {
		return 0, d.err
	}
	return copy(d.b[off:], p), nil
}
func (d *flatDev) WriteAtFUA(p []byte, off int64) error {
	_, err := d.WriteAt(p, off)
	d.mu.Lock()
	d.fuas++
	d.mu.Unlock()
	return err
}
func (d *flatDev) Flush() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.flushes++
	return d.err
}
func (d *flatDev) Trim(off, n int64) error { return d.Zero(off, n, false, false) }
func (d *flatDev) Zero(off, n int64, _, _ bool) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	clear(d.b[off : off+n])
	return d.err
}
func (d *flatDev) Cache(off, n int64) error { return d.err }

// BlockStatus: zero 4 KiB blocks are holes, so tests can predict it.
func (d *flatDev) BlockStatus(off, n int64, dst []Extent) ([]Extent, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for pos := off; pos < off+n; {
		l := min(4096-pos%4096, off+n-pos)
		var f uint32 = StateHole | StateZero
		for _, c := range d.b[pos : pos+l] {
			if c != 0 {
				f = 0
				break
			}
		}
		dst = append(dst, Extent{Length: uint32(l), Flags: f})
		pos += l
	}
	return dst, d.err
}

// asyncFake holds requests until the test releases them, so tests can
// complete out of order, hold a request across Shutdown, and so on.
type asyncFake struct {
	size uint64
	caps Caps
	mu   sync.Mutex
	held []*Request
	got  chan *Request
	data []byte
}

func newAsync(size int) *asyncFake {
	return &asyncFake{size: uint64(size), caps: CapFlush | CapFUA | CapMultiConn,
		got: make(chan *Request, 1024), data: make([]byte, size)}
}

func (a *asyncFake) Size() uint64 { return a.size }
func (a *asyncFake) Caps() Caps   { return a.caps }
func (a *asyncFake) Submit(r *Request) {
	a.mu.Lock()
	a.held = append(a.held, r)
	a.mu.Unlock()
	a.got <- r
}

// wait returns once n requests are held.
func (a *asyncFake) wait(t *testing.T, n int) []*Request {
	t.Helper()
	for range n {
		<-a.got
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]*Request(nil), a.held...)
}

// finish performs r against data and completes it.
func (a *asyncFake) finish(r *Request, err error) {
	a.mu.Lock()
	for i, h := range a.held {
		if h == r {
			a.held = append(a.held[:i], a.held[i+1:]...)
			break
		}
	}
	switch r.Op {
	case OpRead:
		copy(r.Data, a.data[r.Offset:])
	case OpWrite:
		copy(a.data[r.Offset:], r.Data)
	}
	a.mu.Unlock()
	r.Complete(err)
}

func newTestServer(t testing.TB, exports ...Export) *Server {
	s := NewServer(Config{})
	for _, e := range exports {
		if err := s.AddExport(e); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		s.Shutdown(ctx)
	})
	return s
}

// state returns a copy of the contents and the flush/FUA counters.
func (d *flatDev) state() (b []byte, flushes, fuas int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]byte(nil), d.b...), d.flushes, d.fuas
}
