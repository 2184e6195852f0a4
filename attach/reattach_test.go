package attach

import (
	"bytes"
	"encoding/binary"
	"io"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rbd-nbd-go/rbd-nbd-go/backend"
	"github.com/rbd-nbd-go/rbd-nbd-go/control"
	"github.com/rbd-nbd-go/rbd-nbd-go/kernel"
)

// replied reports whether sock has bytes to read within wait: the
// kernel's view of whether anyone answered.
func replied(sock *os.File, wait time.Duration) bool {
	p := []unix.PollFd{{Fd: int32(sock.Fd()), Events: unix.POLLIN}}
	n, err := unix.Poll(p, int(wait.Milliseconds()))
	if err != nil || n == 0 {
		return false
	}
	var b [1]byte
	n, _, err = unix.Recvfrom(int(sock.Fd()), b[:], unix.MSG_PEEK|unix.MSG_DONTWAIT)
	return err == nil && n > 0
}

// hungUp reports whether sock's peer closed it without a byte sent: an
// end of file, or ECONNRESET, which is what a unix socket closed with
// our request unread in it gives (and which a read then clears, as the
// kernel's receive worker would).
func hungUp(sock *os.File) bool {
	var b [1]byte
	n, _, err := unix.Recvfrom(int(sock.Fd()), b[:], unix.MSG_PEEK|unix.MSG_DONTWAIT)
	return (n == 0 && err == nil) || err == unix.ECONNRESET
}

// kernelSock is the fake kernel's first socket of device index, as the
// last RECONFIGURE left it.
func (k *fakeKernel) kernelSock(index int) *os.File {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.devs[index].socks[0]
}

func (k *fakeKernel) reconfigured() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return len(k.reconfigs)
}

// After a restart, with NBD's timeout off, the kernel gets its new
// sockets before the image is even open, so that its resend timer runs
// while the image opens and its fence and lock are taken; but not one
// request is read before the backend is active, so nothing reaches the
// image first. An activation that fails closes the sockets unread: the
// kernel keeps its requests for the next attach. With an io-timeout the
// kernel would time out what sits unread: the image is opened, fenced
// and locked first, and the sockets served as soon as they are handed.
func TestReattachReadsNothingBeforeActivate(t *testing.T) {
	data := bytes.Repeat([]byte("deferred"), 512)
	for _, tc := range []struct {
		name      string
		ioTimeout time.Duration
		fail      bool
	}{{"no timeout, lock fails", 0, true}, {"no timeout", 0, false}, {"io-timeout", 8 * time.Second, false}} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t)
			spec := r.file(t, 4<<20)
			m1 := NewManager(Config{Kernel: r.k, Store: r.store, SysBlock: r.sys, Dev: r.dir})
			rec, err := m1.Map(control.Record{Index: kernel.AnyIndex, Spec: spec, Cookie: "vol-8",
				MapOptions: control.MapOptions{IOTimeout: tc.ioTimeout}})
			if err != nil {
				t.Fatal(err)
			}
			if err := m1.Close(); err != nil {
				t.Fatal(err)
			}
			first := tc.ioTimeout == 0
			activate := make(chan error, 1)
			type opening struct{ deferred, handed bool }
			opened := make(chan opening, 1)
			before := r.k.reconfigured()
			m := NewManager(Config{Kernel: r.k, Store: r.store, SysBlock: r.sys, Dev: r.dir, ReattachWait: 2 * time.Second,
				open: func(spec string, o backend.Options) (*backend.Opened, error) {
					opened <- opening{o.Deferred, r.k.reconfigured() > before}
					op, err := backend.Open(spec, o)
					if err != nil {
						return nil, err
					}
					return backend.NewOpened(op.Backend, op.Describe, func() error { return <-activate }, op.Close), nil
				}})
			if !first {
				activate <- nil // a plain open's Activate does nothing
			}
			done := make(chan error, 1)
			go func() { done <- m.Restore() }()
			if o := <-opened; o.deferred != first || o.handed != first {
				t.Fatalf("open: Deferred %v, sockets already handed %v; want %v for both", o.deferred, o.handed, first)
			}
			for end := time.Now().Add(5 * time.Second); r.k.reconfigured() == before; time.Sleep(5 * time.Millisecond) {
				if time.Now().After(end) {
					t.Fatal("no RECONFIGURE")
				}
			}
			sock := r.k.kernelSock(rec.Index)
			if err := writeReq(sock, cmdWrite, 7, 0, 4096, data); err != nil {
				t.Fatal(err)
			}
			if first {
				if replied(sock, 300*time.Millisecond) {
					t.Fatal("a request was answered before the backend was active")
				}
				if tc.fail {
					activate <- errInjected
					if err := <-done; err == nil {
						t.Fatal("Restore succeeded with a backend that did not activate")
					}
					if !hungUp(sock) {
						t.Fatal("after a failed activation the kernel's socket is not closed, or was answered")
					}
					if len(m.List()) != 0 {
						t.Fatalf("a device is served after a failed activation: %v", m.List())
					}
					return
				}
				activate <- nil
			}
			if err := <-done; err != nil {
				t.Fatal(err)
			}
			// The write the kernel had sent is read now, and answered.
			var reply [16]byte
			if _, err := io.ReadFull(sock, reply[:]); err != nil || binary.BigEndian.Uint32(reply[4:]) != 0 {
				t.Fatalf("reply %x, err %v", reply, err)
			}
			if e, got := kio(t, sock, cmdRead, 0, 4096, nil); e != 0 || !bytes.Equal(got, data) {
				t.Fatalf("read back: errno %d", e)
			}
			if first {
				// The kernel was handed the sockets without a size, and
				// given the image's once it was open.
				r.k.mu.Lock()
				rcs := r.k.reconfigs[before:]
				r.k.mu.Unlock()
				if rcs[0].Size != 0 || rcs[len(rcs)-1].Size != 4<<20 {
					t.Fatalf("RECONFIGUREs %+v: want the sockets without a size, then the size", rcs)
				}
			}
		})
	}
}
