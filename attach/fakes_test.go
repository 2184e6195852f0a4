package attach

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/rbd-nbd-go/rbd-nbd-go/kernel"
)

// fakeKernel is a kernel.Controller that keeps the sockets it is given and
// lets tests speak NBD on them the way the kernel's nbd driver does.
type fakeKernel struct {
	mu         sync.Mutex
	devs       map[int]*fakeDev
	connectErr error
	reconfigs  []kernel.Reconfig
}

type fakeDev struct {
	cfg       kernel.Config
	socks     []*os.File
	connected bool
}

func newFakeKernel() *fakeKernel { return &fakeKernel{devs: map[int]*fakeDev{}} }

func (k *fakeKernel) Name() string { return "fake" }
func (k *fakeKernel) Close() error { return nil }

func dupFile(f *os.File) *os.File {
	fd, err := unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		panic(err)
	}
	return os.NewFile(uintptr(fd), "kernel-end")
}

func (k *fakeKernel) Connect(cfg kernel.Config, socks []*os.File) (int, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.connectErr != nil {
		return 0, k.connectErr
	}
	idx := cfg.Index
	if idx == kernel.AnyIndex {
		for idx = 0; k.devs[idx] != nil && k.devs[idx].connected; idx++ {
		}
	} else if d := k.devs[idx]; d != nil && d.connected {
		return 0, fmt.Errorf("/dev/nbd%d is busy (already connected)", idx)
	}
	d := &fakeDev{cfg: cfg, connected: true}
	for _, s := range socks {
		d.socks = append(d.socks, dupFile(s))
	}
	d.cfg.Index = idx
	k.devs[idx] = d
	return idx, nil
}

// dead reports whether our peer has closed the socket, as the kernel's
// receive worker would notice.
func dead(f *os.File) bool {
	var b [1]byte
	n, _, err := unix.Recvfrom(int(f.Fd()), b[:], unix.MSG_PEEK|unix.MSG_DONTWAIT)
	return n == 0 && err == nil
}

func (k *fakeKernel) Reconfigure(index int, rc kernel.Reconfig, socks []*os.File) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	d := k.devs[index]
	if d == nil || !d.connected {
		return fmt.Errorf("nbd reconfigure: %w", syscall.EINVAL)
	}
	if d.cfg.BackendID != "" && rc.BackendID != d.cfg.BackendID {
		return fmt.Errorf("nbd reconfigure: wrong cookie: %w", syscall.EINVAL)
	}
	k.reconfigs = append(k.reconfigs, rc)
	for _, s := range socks {
		replaced := false
		for i, old := range d.socks {
			if dead(old) {
				old.Close()
				d.socks[i] = dupFile(s)
				replaced = true
				break
			}
		}
		if !replaced {
			// As the kernel does: the socket is dropped, and
			// RECONFIGURE still succeeds.
			break
		}
	}
	if rc.Size != 0 {
		d.cfg.Size = rc.Size
	}
	return nil
}

func (k *fakeKernel) Disconnect(index int) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	d := k.devs[index]
	if d == nil || !d.connected {
		return fmt.Errorf("nbd disconnect: %w", syscall.EINVAL)
	}
	for _, s := range d.socks {
		writeReq(s, cmdDisc, 0, 0, 0, nil)
		unix.Shutdown(int(s.Fd()), unix.SHUT_WR)
	}
	d.connected = false
	return nil
}

func (k *fakeKernel) Status(index int) (kernel.Status, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	d := k.devs[index]
	if d == nil {
		return kernel.Status{}, os.ErrNotExist
	}
	return kernel.Status{Index: index, Connected: d.connected}, nil
}

func (k *fakeKernel) dev(t *testing.T, index int) *fakeDev {
	t.Helper()
	k.mu.Lock()
	defer k.mu.Unlock()
	d := k.devs[index]
	if d == nil {
		t.Fatalf("no device %d in the fake kernel", index)
	}
	return d
}

// The kernel's side of NBD transmission: 28-byte requests, simple replies.
const (
	cmdRead  = 0
	cmdWrite = 1
	cmdDisc  = 2
	cmdFlush = 3
)

func writeReq(w io.Writer, cmd uint16, handle, off uint64, n uint32, data []byte) error {
	var h [28]byte
	binary.BigEndian.PutUint32(h[0:], 0x25609513)
	binary.BigEndian.PutUint16(h[6:], cmd)
	binary.BigEndian.PutUint64(h[8:], handle)
	binary.BigEndian.PutUint64(h[16:], off)
	binary.BigEndian.PutUint32(h[24:], n)
	_, err := w.Write(append(h[:], data...))
	return err
}

// kio does one request on sock and returns the reply's error and data.
func kio(t *testing.T, sock *os.File, cmd uint16, off uint64, n uint32, data []byte) (uint32, []byte) {
	t.Helper()
	if err := writeReq(sock, cmd, 7, off, n, data); err != nil {
		t.Fatal(err)
	}
	var r [16]byte
	if _, err := io.ReadFull(sock, r[:]); err != nil {
		t.Fatal(err)
	}
	if binary.BigEndian.Uint32(r[0:]) != 0x67446698 || binary.BigEndian.Uint64(r[8:]) != 7 {
		t.Fatalf("bad reply %x", r)
	}
	errno := binary.BigEndian.Uint32(r[4:])
	var out []byte
	if cmd == cmdRead && errno == 0 {
		out = make([]byte, n)
		if _, err := io.ReadFull(sock, out); err != nil {
			t.Fatal(err)
		}
	}
	return errno, out
}

var errInjected = errors.New("injected")
