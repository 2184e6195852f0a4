package nbd

import (
	"math/bits"
	"sync"
)

// Payload buffers come from power-of-two size classes, 512 B to MaxPayload,
// each a sync.Pool of *[]byte (a pointer, so Put does not allocate). In
// steady state every READ and WRITE reuses a buffer instead of allocating.
const (
	minClassShift = 9
	maxClassShift = 25 // 32 MiB = MaxPayload
)

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
func (p *bufPool) get(n int) *[]byte {
	c := classOf(n)
	if b, ok := p.classes[c].Get().(*[]byte); ok {
		*b = (*b)[:n]
		return b
	}
	s := make([]byte, n, 1<<(c+minClassShift))
	return &s
}

func (p *bufPool) put(b *[]byte) {
	p.classes[classOf(cap(*b))].Put(b)
}
