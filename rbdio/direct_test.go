package rbdio

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"io"
	"testing"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
)

// TestDirectReplies: on a kernel-style unix socket, small requests are
// answered from librbd's completion thread (nbd.Request.DirectReply),
// the rest by the server, on the same socket at the same time. Every
// request must get exactly one whole reply, reads the bytes written
// before them, and the image must end up as written. Deep queues and
// large replies sent by the server make both senders contend for the
// socket (nbd's own test fills it on purpose). With NoDirectReplies,
// none may be sent directly.
func TestDirectReplies(t *testing.T) {
	for _, off := range []bool{false, true} {
		name := map[bool]string{false: "on", true: "off"}[off]
		t.Run(name, func(t *testing.T) {
			direct, flushes := directReplies(t, off)
			switch {
			case off && direct[1] != 0:
				t.Fatalf("%d replies sent directly with NoDirectReplies", direct[1])
			case off:
			case direct[0] == 0 || direct[1]-direct[0] <= flushes:
				// Reads, not only flushes, must have gone out directly.
				t.Fatalf("replies sent by the completion callback: %d writes, %d reads and flushes: the test did not test direct replies",
					direct[0], direct[1]-direct[0])
			}
			t.Logf("%d replies sent directly, %d in the read phase", direct[1], direct[1]-direct[0])
		})
	}
}

// directReplies runs the test's requests and returns how many replies
// were sent directly after each phase, and the read phase's flushes.
func directReplies(t *testing.T, noDirect bool) (direct [2]uint64, flushes uint64) {
	const size = 8 << 20
	spec := newImage(t, "8M")
	im := open(t, NewClusters(), spec, OpenOptions{})
	s := nbd.NewServer(nbd.Config{NoDirectReplies: noDirect})
	if err := s.AddExport(nbd.Export{Backend: im}); err != nil {
		t.Fatal(err)
	}
	a, c := socketpair(t)
	go s.ServeNegotiated(a, "")
	c.SetDeadline(time.Now().Add(120 * time.Second))

	// Phase 1 writes distinct blocks (some FUA, some trimmed or zeroed
	// after), phase 2 reads them back (4 KiB to 128 KiB, so some lent)
	// with flushes mixed in: within a phase no two requests overlap.
	type req struct {
		cmd, flags uint16
		off, n     int
		data       []byte
	}
	want := make([]byte, size)
	var w1, w2 []req
	for off := 0; off < size; off += 64 << 10 {
		n := 4096 << (off / (64 << 10) % 4) // 4-32 KiB
		b := make([]byte, n)
		rand.Read(b)
		copy(want[off:], b)
		flags := uint16(0)
		if off%(1<<20) == 0 {
			flags = 1 // FUA
		}
		w1 = append(w1, req{cmd: 1, flags: flags, off: off, n: n, data: b})
		if off%(512<<10) == 64<<10 {
			w1 = append(w1, req{cmd: 4, off: off + 32<<10, n: 16 << 10}) // trim
			clear(want[off+32<<10 : off+48<<10])
		}
		if off%(512<<10) == 128<<10 {
			w1 = append(w1, req{cmd: 6, off: off + 48<<10, n: 8 << 10}) // write zeroes
			clear(want[off+48<<10 : off+56<<10])
		}
	}
	w1 = append(w1, req{cmd: 3}) // flush
	for off := 0; off < size; off += 128 << 10 {
		w2 = append(w2, req{cmd: 0, off: off, n: 4096 << (off / (128 << 10) % 6)})
		if off%(1<<20) == 0 {
			w2 = append(w2, req{cmd: 3})
		}
	}
	br := bufio.NewReader(c)
	// settle finishes every request of a phase: a reply can reach the
	// client before its completion is queued.
	settle := func() {
		for {
			im.Waiting(true)
			im.Waiting(false)
			im.mu.Lock()
			n := im.inflight
			im.mu.Unlock()
			if n == 0 {
				return
			}
			time.Sleep(time.Millisecond)
		}
	}
	for phase, reqs := range [][]req{w1, w2} {
		go func() {
			h := make([]byte, 28)
			for i, r := range reqs {
				binary.BigEndian.PutUint32(h[0:], 0x25609513)
				binary.BigEndian.PutUint16(h[4:], r.flags)
				binary.BigEndian.PutUint16(h[6:], r.cmd)
				binary.BigEndian.PutUint64(h[8:], uint64(i))
				binary.BigEndian.PutUint64(h[16:], uint64(r.off))
				binary.BigEndian.PutUint32(h[24:], uint32(r.n))
				if _, err := c.Write(h); err != nil {
					return
				}
				if r.cmd == 1 {
					if _, err := c.Write(r.data); err != nil {
						return
					}
				}
			}
		}()
		seen := make([]bool, len(reqs))
		h := make([]byte, 16)
		for range reqs {
			if _, err := io.ReadFull(br, h); err != nil {
				t.Fatalf("phase %d: %v", phase, err)
			}
			if m, e := binary.BigEndian.Uint32(h), binary.BigEndian.Uint32(h[4:]); m != 0x67446698 || e != 0 {
				t.Fatalf("phase %d: reply magic %#x error %d", phase, m, e)
			}
			i := binary.BigEndian.Uint64(h[8:])
			if i >= uint64(len(reqs)) || seen[i] {
				t.Fatalf("phase %d: reply to cookie %d unexpected", phase, i)
			}
			seen[i] = true
			if r := reqs[i]; r.cmd == 0 {
				got := make([]byte, r.n)
				if _, err := io.ReadFull(br, got); err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(got, want[r.off:r.off+r.n]) {
					t.Fatalf("read %d bytes at %d: not what was written", r.n, r.off)
				}
			}
		}
		settle()
		direct[phase] = im.direct.Load()
	}
	c.Close()
	if err := s.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(export(t, spec), want) {
		t.Fatal("image differs from what was written")
	}
	for _, r := range w2 {
		if r.cmd == 3 {
			flushes++
		}
	}
	return direct, flushes
}

// TestReapAfterClose: the server's watchdog may reap for a connection
// that has just ended, after its image was closed and its queue freed.
func TestReapAfterClose(t *testing.T) {
	im, err := Open(NewClusters(), opts(), newImage(t, "4M"), OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := do(t, im, nbd.OpWrite, 0, 0, make([]byte, 4096), 4096); err != nil {
		t.Fatal(err)
	}
	if err := im.Close(); err != nil {
		t.Fatal(err)
	}
	im.Reap()
	im.Waiting(true)
	im.Waiting(false)
}
