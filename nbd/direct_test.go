package nbd

import (
	"bufio"
	"bytes"
	"context"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// foreignDev completes requests on goroutines of its own and, like
// rbdio's C callback, sends some success replies itself through the
// port (raw atomics on its C layout, a non-blocking sendmsg), finishing
// them only when the server reaps.
type foreignDev struct {
	dev      *flatDev
	work     chan *Request
	mu       sync.Mutex
	lazy     []*Request
	inflight atomic.Int64
	waiters  atomic.Int32
	direct   atomic.Int64
	fellBack atomic.Int64
	partial  atomic.Int64
}

func newForeign(size, workers int) *foreignDev {
	d := &foreignDev{dev: newFlat(size), work: make(chan *Request, 1024)}
	for range workers {
		go d.worker()
	}
	return d
}

func (d *foreignDev) Size() uint64 { return d.dev.Size() }
func (d *foreignDev) Caps() Caps   { return CapFlush | CapTrim | CapZeroes }
func (d *foreignDev) Submit(r *Request) {
	d.inflight.Add(1)
	d.work <- r
}

func (d *foreignDev) Reap() {
	d.mu.Lock()
	lazy := d.lazy
	d.lazy = nil
	d.mu.Unlock()
	for _, r := range lazy {
		r.Sent()
	}
}

func (d *foreignDev) Waiting(on bool) {
	if on {
		d.waiters.Add(1)
		d.Reap()
		return
	}
	d.waiters.Add(-1)
}

func (d *foreignDev) worker() {
	for r := range d.work {
		port, hdr, ok := r.DirectReply()
		var err error
		switch r.Op {
		case OpRead:
			_, err = d.dev.ReadAt(r.Data, int64(r.Offset))
		case OpWrite:
			_, err = d.dev.WriteAt(r.Data, int64(r.Offset))
		case OpFlush:
			err = d.dev.Flush()
		case OpTrim, OpWriteZeroes:
			err = d.dev.Zero(int64(r.Offset), int64(r.Length), false, false)
		}
		if ok && err == nil && rand.IntN(4) > 0 && d.send(port, hdr, r) {
			d.direct.Add(1)
			d.mu.Lock()
			d.lazy = append(d.lazy, r)
			d.mu.Unlock()
		} else {
			if ok {
				d.fellBack.Add(1)
			}
			r.Complete(err)
		}
		if d.inflight.Add(-1) == 0 || d.waiters.Load() > 0 {
			d.Reap() // as the C callback signals the reaper
		}
	}
}

// send is rbdio's nbdgo_send_reply in Go: a partial send tears the
// stream, and the test fails.
func (d *foreignDev) send(port unsafe.Pointer, hdr []byte, r *Request) bool {
	lock := (*uint32)(port)
	fd := *(*int32)(unsafe.Add(port, 4))
	dead := (*uint32)(unsafe.Add(port, 8))
	if !atomic.CompareAndSwapUint32(lock, 0, 1) {
		return false
	}
	defer atomic.StoreUint32(lock, 0)
	if atomic.LoadUint32(dead) != 0 {
		return false
	}
	bufs := [][]byte{hdr}
	if r.Op == OpRead {
		bufs = append(bufs, r.Data)
	}
	want := 0
	for _, b := range bufs {
		want += len(b)
	}
	n, err := unix.SendmsgBuffers(int(fd), bufs, nil, nil, unix.MSG_DONTWAIT|unix.MSG_NOSIGNAL)
	if err == nil && n != want {
		d.partial.Add(1)
		atomic.StoreUint32(dead, portTorn)
		unix.Shutdown(int(fd), unix.SHUT_RDWR)
		return false
	}
	return err == nil
}

func TestReplyPortLayout(t *testing.T) {
	// rbdio's struct nbdgo_port is {uint32 lock; int32 fd; uint32 dead}.
	var p replyPort
	if unsafe.Offsetof(p.fd) != 4 || unsafe.Offsetof(p.dead) != 8 || unsafe.Sizeof(p) != 12 {
		t.Fatalf("replyPort layout changed: fd at %d, dead at %d, size %d",
			unsafe.Offsetof(p.fd), unsafe.Offsetof(p.dead), unsafe.Sizeof(p))
	}
}

// TestDirectReplies: replies sent from a backend's own threads and by
// the server share one socket, under load and with the socket often
// full (tiny send buffer, a client that reads in bursts). Every request
// gets exactly one whole reply, and reads see what was written before.
func TestDirectReplies(t *testing.T) {
	for _, tc := range []struct {
		name       string
		structured bool
	}{{"simple", false}, {"structured", true}} {
		t.Run(tc.name, func(t *testing.T) {
			const size = 4 << 20
			d := newForeign(size, 4)
			// Cleanups run last-in first-out: the workers stop only
			// after Shutdown has waited out every reader that submits.
			t.Cleanup(func() { close(d.work) })
			// 16 KiB asked, 32 KiB given: 16 KiB reads too large to
			// offer, 8 KiB ones just small enough.
			s := NewServer(Config{SendBuffer: 16 << 10, MaxInflight: 64})
			st := NewStats()
			s.AddExport(Export{Backend: d, Stats: st})
			t.Cleanup(func() { s.Shutdown(context.Background()) })
			var c *tclient
			if tc.structured {
				c = connect(t, s)
				c.open("", true)
			} else {
				a, b := socketpair(t)
				go s.ServeNegotiated(a, "")
				c = &tclient{t: t, c: b, br: bufio.NewReader(b)}
				t.Cleanup(func() { b.Close() })
			}
			c.c.SetDeadline(time.Now().Add(60 * time.Second))
			want := make([]byte, size)
			cookie := uint64(0)
			for round := range 8 {
				// Writes to distinct blocks, then reads of them: within a
				// round no two requests overlap.
				lens := map[uint64]int{}
				ops := map[uint64]uint16{}
				var offs []int
				for range 64 {
					offs = append(offs, rand.IntN(size/(16<<10))*(16<<10))
				}
				seen := map[int]bool{}
				for _, off := range offs {
					if seen[off] {
						continue
					}
					seen[off] = true
					n := 512 << rand.IntN(6) // 512 B - 16 KiB
					b := pattern(n, byte(round*64+off/4096))
					copy(want[off:], b)
					cookie++
					lens[cookie], ops[cookie] = 0, cmdWrite
					c.send(cmdWrite, 0, cookie, uint64(off), uint32(n), b)
				}
				cookie++
				ops[cookie] = cmdFlush
				c.send(cmdFlush, 0, cookie, 0, 0, nil)
				c.expectReplies(ops, lens, nil)
				reads := map[uint64]int{}
				for off := range seen {
					n := 4096 << rand.IntN(3)
					cookie++
					lens[cookie], ops[cookie], reads[cookie] = n, cmdRead, off
					c.send(cmdRead, 0, cookie, uint64(off), uint32(n), nil)
				}
				c.expectReplies(ops, lens, func(ck uint64, data []byte) {
					if off := reads[ck]; !bytes.Equal(data, want[off:off+len(data)]) {
						t.Fatalf("read at %d: not what was written", off)
					}
				})
			}
			if d.partial.Load() > 0 {
				t.Fatalf("%d direct sends went out in part", d.partial.Load())
			}
			if d.direct.Load() == 0 || d.fellBack.Load() == 0 {
				t.Fatalf("direct %d, fell back %d: both paths must be exercised", d.direct.Load(), d.fellBack.Load())
			}
			// Every request counted, sent directly or not.
			sn := st.Snapshot()
			if n := sn.Ops["write"].Requests + sn.Ops["read"].Requests + sn.Ops["flush"].Requests; n != cookie {
				t.Fatalf("%d requests counted of %d answered (%d sent directly)", n, cookie, d.direct.Load())
			}
			t.Logf("%d replies sent directly, %d offered ones fell back", d.direct.Load(), d.fellBack.Load())
		})
	}
}

// expectReplies reads one reply per entry of ops (then forgets them),
// handing each READ's data to check.
func (c *tclient) expectReplies(ops map[uint64]uint16, lens map[uint64]int, check func(uint64, []byte)) {
	c.t.Helper()
	for len(ops) > 0 {
		// A simple reply does not say its length: peek the cookie
		// (at 8 in both kinds of reply).
		h, err := c.br.Peek(16)
		if err != nil {
			c.t.Fatal(err)
		}
		ck := be.Uint64(h[8:])
		op, ok := ops[ck]
		if !ok {
			c.t.Fatalf("reply to cookie %d: not in flight", ck)
		}
		rl := 0
		if op == cmdRead {
			rl = lens[ck]
		}
		r := c.recv(rl)
		if r.errno != 0 {
			c.t.Fatalf("cookie %d: error %d", ck, r.errno)
		}
		if op == cmdRead {
			if len(r.data) != lens[ck] {
				c.t.Fatalf("cookie %d: %d bytes read, want %d", ck, len(r.data), lens[ck])
			}
			check(ck, r.data)
		}
		delete(ops, ck)
		delete(lens, ck)
	}
}
