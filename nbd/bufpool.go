package nbd

import (
	"math/bits"
	"runtime"
	"sync"

	"golang.org/x/sys/unix"
)

// Payload buffers come from power-of-two size classes, 512 B to MaxPayload,
// each a sync.Pool of *payload (a pointer, so Put does not allocate). In
// steady state every READ and WRITE reuses a buffer instead of allocating.
//
// Classes from mappedMin up live outside the Go heap, in their own
// anonymous mappings. A READ payload spliced into a socket is referenced
// by page, not copied, until the peer has read it; Go heap memory the
// collector frees could be handed to another object meanwhile and the
// peer would read that object's bytes. A mapping is only ever unmapped
// (a cleanup once the pool drops it), never reused while it may still be
// referenced, and unmapping leaves pages the kernel holds intact.
const (
	minClassShift = 9
	maxClassShift = 25 // 32 MiB = MaxPayload
	mappedMin     = zeroCopyMin
)

type payload struct {
	b      []byte
	mapped bool // outside the Go heap: safe to splice
}

type bufPool struct {
	classes [maxClassShift - minClassShift + 1]sync.Pool
}

func classOf(n int) int {
	if n <= 1<<minClassShift {
		return 0
	}
	return bits.Len(uint(n-1)) - minClassShift
}

// get returns a buffer of length n (n <= MaxPayload).
func (p *bufPool) get(n int) *payload {
	c := classOf(n)
	if b, ok := p.classes[c].Get().(*payload); ok {
		b.b = b.b[:n]
		return b
	}
	size := 1 << (c + minClassShift)
	if size >= mappedMin {
		if m, err := unix.Mmap(-1, 0, size, unix.PROT_READ|unix.PROT_WRITE,
			unix.MAP_PRIVATE|unix.MAP_ANONYMOUS); err == nil {
			b := &payload{b: m[:n], mapped: true}
			runtime.AddCleanup(b, func(m []byte) { unix.Munmap(m) }, m)
			return b
		}
	}
	return &payload{b: make([]byte, n, size)}
}

func (p *bufPool) put(b *payload) {
	p.classes[classOf(cap(b.b))].Put(b)
}
