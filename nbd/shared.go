package nbd

import (
	"bufio"
	"io"
	"sync"
	"sync/atomic"
)

// DefaultMemoryBudget is the payload memory a Shared lets requests hold in
// flight at once, over every connection it serves. One device at queue
// depth 32 with 1 MiB requests holds 32 MiB; 512 MiB lets sixteen such
// devices run flat out together, and is what a node daemon locks at
// most for payloads however many devices and connections it serves.
const DefaultMemoryBudget = 512 << 20

// readBufSize is a busy connection's read buffer: a burst of 4 KiB
// writes (headers and payloads) is read in few read(2) calls. 16 KiB was
// measured and rejected: BenchmarkWrite4K went from about 2 to 3 µs.
const readBufSize = 64 << 10

// A Shared is what the servers of one process share: payload buffers, the
// budget on payload bytes in flight, the read buffers of busy
// connections and the watcher that parks idle ones. A node daemon runs a
// Server per device over one Shared, so its memory follows the I/O in
// flight rather than devices × connections: an idle connection holds no
// read buffer (it goes back here when the reader parks) and no thread.
// Every part shrinks when idle: buffers live in sync.Pools, which the
// garbage collector empties of what nobody took back.
type Shared struct {
	bufs   bufPool
	idle   idleWatcher
	reads  sync.Pool // *bufio.Reader of readBufSize
	budget budget
	dog    watchdog
}

// NewShared returns a Shared whose requests hold at most budget payload
// bytes in flight (DefaultMemoryBudget if budget <= 0), except that a
// connection with nothing in flight may always take one request, so no
// connection ever stalls for good behind others.
func NewShared(budget int) *Shared {
	if budget <= 0 {
		budget = DefaultMemoryBudget
	}
	p := &Shared{}
	p.budget.max = int64(budget)
	p.budget.cond.L = &p.budget.mu
	p.dog.every, p.dog.after = slowTick, slowAfter
	return p
}

// InFlight reports the payload bytes requests hold now.
func (p *Shared) InFlight() int64 { return p.budget.used.Load() }

// reader returns a read buffer over r.
func (p *Shared) reader(r io.Reader) *bufio.Reader {
	if br, ok := p.reads.Get().(*bufio.Reader); ok {
		br.Reset(r)
		return br
	}
	return bufio.NewReaderSize(r, readBufSize)
}

// putReader takes back a read buffer with nothing buffered.
func (p *Shared) putReader(br *bufio.Reader) {
	br.Reset(nil)
	p.reads.Put(br)
}

// budget counts payload bytes in flight across connections. The fast
// path is one atomic add; only a request over the budget takes the lock.
type budget struct {
	max     int64
	used    atomic.Int64
	waiting atomic.Int32
	mu      sync.Mutex
	cond    sync.Cond
}

// tryTake reserves n bytes if they fit.
func (b *budget) tryTake(n int) bool {
	if b.used.Add(int64(n)) <= b.max {
		return true
	}
	b.used.Add(-int64(n))
	return false
}

// take reserves n bytes, over the budget if it must.
func (b *budget) take(n int) { b.used.Add(int64(n)) }

// waitTake reserves n bytes once they fit, or at once (over the budget)
// when the caller's own bytes in flight, mine, fall to 0: a connection
// must not wait for other connections' requests, which may be stuck in
// a backend for good, when its own are all answered. The waiter is
// counted before it looks, so a give that comes after the look (the
// caller's own included: mine drops before its give) sees it and wakes
// it.
func (b *budget) waitTake(n int, mine *atomic.Int64) {
	b.mu.Lock()
	b.waiting.Add(1)
	for !b.tryTake(n) {
		if mine.Load() == 0 {
			b.take(n)
			break
		}
		b.cond.Wait()
	}
	b.waiting.Add(-1)
	b.mu.Unlock()
}

// give returns n bytes, waking waiters if there are any.
func (b *budget) give(n int) {
	if n == 0 {
		return
	}
	b.used.Add(-int64(n))
	if b.waiting.Load() > 0 {
		b.mu.Lock()
		b.cond.Broadcast()
		b.mu.Unlock()
	}
}
