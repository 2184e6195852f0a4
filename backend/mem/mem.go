// Package mem is a sparse in-memory block device: a 1 TiB export costs a
// few kilobytes until written. It serves tests, benchmarks and `serve mem:`.
package mem

import (
	"sync"
	"sync/atomic"

	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
)

// Memory is kept in 64 KiB chunks found through a two-level table: a
// top-level slot per GiB points to a table of chunk pointers. Unwritten
// space has neither, so size costs 8 bytes per GiB up front. Pointers are
// atomic so lookups take no lock; each chunk has its own RWMutex so
// concurrent I/O to different chunks never contends.
const (
	chunkShift = 16
	chunkSize  = 1 << chunkShift
	l2Shift    = 30 - chunkShift // chunks per GiB, as a shift
	l2Entries  = 1 << l2Shift
)

type chunk struct {
	mu   sync.RWMutex
	data [chunkSize]byte
}

type l2 [l2Entries]atomic.Pointer[chunk]

// Device implements nbd.Device plus trim, zero, block status, flush and
// cache, so every NBD feature can be exercised against it.
type Device struct {
	size     uint64
	readOnly bool
	top      []atomic.Pointer[l2]
	chunks   atomic.Int64
}

// New returns a zero-filled device of size bytes.
func New(size uint64, readOnly bool) *Device {
	gib := (size + 1<<30 - 1) >> 30
	return &Device{size: size, readOnly: readOnly, top: make([]atomic.Pointer[l2], gib)}
}

func (d *Device) Size() uint64   { return d.size }
func (d *Device) ReadOnly() bool { return d.readOnly }

// Allocated reports bytes of memory held for data.
func (d *Device) Allocated() int64 { return d.chunks.Load() * chunkSize }

func (d *Device) lookup(idx uint64) *chunk {
	t := d.top[idx>>l2Shift].Load()
	if t == nil {
		return nil
	}
	return t[idx&(l2Entries-1)].Load()
}

func (d *Device) lookupOrCreate(idx uint64) *chunk {
	slot := &d.top[idx>>l2Shift]
	t := slot.Load()
	if t == nil {
		t = new(l2)
		if !slot.CompareAndSwap(nil, t) {
			t = slot.Load()
		}
	}
	cp := &t[idx&(l2Entries-1)]
	c := cp.Load()
	if c == nil {
		c = new(chunk)
		if cp.CompareAndSwap(nil, c) {
			d.chunks.Add(1)
		} else {
			c = cp.Load()
		}
	}
	return c
}

// span calls fn for each chunk-sized piece of [off, off+n).
func span(off, n int64, fn func(idx uint64, lo, hi int, done int64)) {
	var done int64
	for done < n {
		pos := off + done
		lo := int(pos & (chunkSize - 1))
		hi := min(chunkSize, lo+int(n-done))
		fn(uint64(pos>>chunkShift), lo, hi, done)
		done += int64(hi - lo)
	}
}

func (d *Device) ReadAt(p []byte, off int64) (int, error) {
	span(off, int64(len(p)), func(idx uint64, lo, hi int, done int64) {
		dst := p[done : done+int64(hi-lo)]
		c := d.lookup(idx)
		if c == nil {
			clear(dst)
			return
		}
		c.mu.RLock()
		copy(dst, c.data[lo:hi])
		c.mu.RUnlock()
	})
	return len(p), nil
}

func (d *Device) WriteAt(p []byte, off int64) (int, error) {
	if d.readOnly {
		return 0, nbd.ErrPerm
	}
	span(off, int64(len(p)), func(idx uint64, lo, hi int, done int64) {
		c := d.lookupOrCreate(idx)
		c.mu.Lock()
		copy(c.data[lo:hi], p[done:])
		c.mu.Unlock()
	})
	return len(p), nil
}

// Flush has nothing to do: memory is as durable as this device gets.
func (d *Device) Flush() error { return nil }

// Trim frees whole chunks and zeroes partial ones.
func (d *Device) Trim(off, n int64) error { return d.Zero(off, n, false, false) }

// Zero zeroes the range. Without noHole whole chunks are freed (they read
// as zeroes); with it they stay allocated.
func (d *Device) Zero(off, n int64, noHole, _ bool) error {
	if d.readOnly {
		return nbd.ErrPerm
	}
	span(off, n, func(idx uint64, lo, hi int, _ int64) {
		whole := lo == 0 && hi == chunkSize
		if whole && !noHole {
			if t := d.top[idx>>l2Shift].Load(); t != nil {
				if t[idx&(l2Entries-1)].Swap(nil) != nil {
					d.chunks.Add(-1)
				}
			}
			return
		}
		var c *chunk
		if noHole {
			c = d.lookupOrCreate(idx)
		} else if c = d.lookup(idx); c == nil {
			return
		}
		c.mu.Lock()
		clear(c.data[lo:hi])
		c.mu.Unlock()
	})
	return nil
}

// Cache is a no-op: everything is already in memory.
func (d *Device) Cache(off, n int64) error { return nil }

// BlockStatus reports unallocated chunks as holes that read as zeroes.
func (d *Device) BlockStatus(off, n int64, dst []nbd.Extent) ([]nbd.Extent, error) {
	span(off, n, func(idx uint64, lo, hi int, _ int64) {
		var f uint32
		if d.lookup(idx) == nil {
			f = nbd.StateHole | nbd.StateZero
		}
		l := uint32(hi - lo)
		if k := len(dst) - 1; k >= 0 && dst[k].Flags == f {
			dst[k].Length += l
			return
		}
		dst = append(dst, nbd.Extent{Length: l, Flags: f})
	})
	return dst, nil
}
