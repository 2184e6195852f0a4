package kernel

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// ioctl numbers from include/uapi/linux/nbd.h (_IO(0xab, n)).
const (
	ioSetSock       = 0xab00
	ioSetBlkSize    = 0xab01
	ioDoIt          = 0xab03
	ioClearSock     = 0xab04
	ioSetSizeBlocks = 0xab07
	ioDisconnect    = 0xab08
	ioSetTimeout    = 0xab09
	ioSetFlags      = 0xab0a
)

// startTimeout bounds the wait for NBD_DO_IT to start a device: the
// kernel freezes the queue to resize its hardware queues first, which
// takes an RCU grace period or so even on a slow VM.
const startTimeout = 30 * time.Second

// Ioctl is the fallback Controller for kernels without the genl family.
// NBD_DO_IT blocks for the device's whole life, so each device keeps one
// locked OS thread in this process; the device goes when the process does.
type Ioctl struct {
	devDir, sysDir string

	mu      sync.Mutex
	running map[int]*doIt // per device this process serves
}

// NewIoctl drives /dev/nbdN through ioctls.
func NewIoctl() *Ioctl {
	return &Ioctl{devDir: "/dev", sysDir: "/sys/block", running: map[int]*doIt{}}
}

func (k *Ioctl) Name() string { return "ioctl" }
func (k *Ioctl) Close() error { return nil }

func (k *Ioctl) path(index int) string { return fmt.Sprintf("%s/nbd%d", k.devDir, index) }

// free reports whether nbdN has no server: the kernel removes the pid
// attribute when the device is not connected.
func (k *Ioctl) free(index int) bool {
	_, err := os.Stat(fmt.Sprintf("%s/nbd%d/pid", k.sysDir, index))
	return errors.Is(err, os.ErrNotExist)
}

// doIt is a device's NBD_DO_IT: ended is closed when it returns, err
// holds what it returned (nil for a requested disconnect).
type doIt struct {
	ended chan struct{}
	err   error
}

func (k *Ioctl) Connect(cfg Config, socks []*os.File) (int, error) {
	if len(socks) == 0 || cfg.Size == 0 {
		return 0, errors.New("connect: need sockets and a size")
	}
	index, run, err := k.reserve(cfg.Index)
	if err != nil {
		return 0, err
	}
	f, err := os.OpenFile(k.path(index), os.O_RDWR, 0)
	if err != nil {
		k.release(index)
		return 0, err
	}
	// The kernel binds a device to the thread that sets its first
	// socket ("being setup by another task" otherwise): setup and
	// NBD_DO_IT all run on one locked thread, which then serves the
	// device for its whole life.
	setup := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		blockSignals()
		if err := k.setup(f.Fd(), index, cfg, socks); err != nil {
			f.Close()
			k.release(index)
			setup <- err
			return
		}
		setup <- nil
		_, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), ioDoIt, 0)
		unix.Syscall(unix.SYS_IOCTL, f.Fd(), ioClearSock, 0)
		f.Close()
		if e != 0 && e != syscall.EPIPE {
			run.err = e
		}
		k.release(index)
		close(run.ended)
	}()
	if err := <-setup; err != nil {
		return 0, err
	}
	bs := cfg.blockSize()
	if err := k.waitStarted(index, cfg.Size/bs*bs, run); err != nil {
		return 0, err
	}
	return index, nil
}

// reserve picks the device (the first free one for AnyIndex) and marks it
// ours, so that a concurrent Connect cannot pick it too.
func (k *Ioctl) reserve(index int) (int, *doIt, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if index == AnyIndex {
		for i := 0; ; i++ {
			if _, err := os.Stat(k.path(i)); err != nil {
				return 0, nil, errors.New("no free /dev/nbdN device (raise --nbds_max)")
			}
			if _, busy := k.running[i]; !busy && k.free(i) {
				index = i
				break
			}
		}
	} else if _, busy := k.running[index]; busy || !k.free(index) {
		return 0, nil, fmt.Errorf("/dev/nbd%d is busy (already connected)", index)
	}
	run := &doIt{ended: make(chan struct{})}
	k.running[index] = run
	return index, run, nil
}

func (k *Ioctl) release(index int) {
	k.mu.Lock()
	delete(k.running, index)
	k.mu.Unlock()
}

// waitStarted returns once the kernel has started the device. Unlike
// netlink's CONNECT, the setup ioctls return before NBD_DO_IT starts it:
// until then the disk has no capacity, and a caller handed the device
// path at once (map prints it) would open an empty disk. Starting a
// device creates its pid attribute and sets the capacity last, and a
// stopped one has neither, so the two together are the signal.
func (k *Ioctl) waitStarted(index int, size uint64, run *doIt) error {
	sizeFile := fmt.Sprintf("%s/nbd%d/size", k.sysDir, index)
	want := strconv.FormatUint(size>>9, 10)
	deadline := time.Now().Add(startTimeout)
	for delay := time.Millisecond; ; delay = min(2*delay, 50*time.Millisecond) {
		if b, err := os.ReadFile(sizeFile); err == nil && strings.TrimSpace(string(b)) == want && !k.free(index) {
			return nil
		}
		select {
		case <-run.ended:
			err := run.err
			if err == nil {
				err = errors.New("the kernel ended the device at once")
			}
			return fmt.Errorf("/dev/nbd%d: start: %w", index, err)
		case <-time.After(delay):
		}
		if time.Now().After(deadline) {
			k.Disconnect(index)
			return fmt.Errorf("/dev/nbd%d: the kernel did not start the device within %v", index, startTimeout)
		}
	}
}

// blockSignals keeps every signal off the calling (locked) thread. The
// kernel waits in NBD_DO_IT interruptibly and shuts the device's sockets
// down when a signal interrupts it; the restarted ioctl then leaves a disk
// with no sockets ("Attempted send on invalid socket"). The Go runtime
// sends signals to its threads (SIGURG to preempt, and a process-directed
// SIGTERM or SIGWINCH may land on any thread that does not block it), so
// one map in 40-100 died that way. SIGKILL still ends the device. The
// thread exits with its goroutine (it stays locked), so no other goroutine
// ever runs with this mask.
func blockSignals() {
	var all unix.Sigset_t
	for i := range all.Val {
		all.Val[i] = ^uint64(0)
	}
	unix.PthreadSigmask(unix.SIG_BLOCK, &all, nil)
}

func (k *Ioctl) setup(fd uintptr, index int, cfg Config, socks []*os.File) error {
	bs := cfg.blockSize()
	type step struct {
		what     string
		req, arg uintptr
	}
	steps := []step{
		{"set block size", ioSetBlkSize, uintptr(bs)},
		{"set size", ioSetSizeBlocks, uintptr(cfg.Size / bs)},
		{"set timeout", ioSetTimeout, uintptr(seconds(cfg.Timeout))},
		{"set flags", ioSetFlags, uintptr(cfg.ServerFlags)},
	}
	for _, s := range socks {
		steps = append(steps, step{"set socket", ioSetSock, s.Fd()})
	}
	for _, s := range steps {
		if _, _, e := unix.Syscall(unix.SYS_IOCTL, fd, s.req, s.arg); e != 0 {
			unix.Syscall(unix.SYS_IOCTL, fd, ioClearSock, 0)
			return fmt.Errorf("/dev/nbd%d: %s: %w", index, s.what, e)
		}
	}
	return nil
}

func (k *Ioctl) Reconfigure(index int, rc Reconfig, socks []*os.File) error {
	if len(socks) == 0 && rc.Size != 0 {
		f, err := os.OpenFile(k.path(index), os.O_RDWR, 0)
		if err != nil {
			return err
		}
		defer f.Close()
		bs := Config{BlockSize: rc.BlockSize}.blockSize()
		if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), ioSetSizeBlocks, uintptr(rc.Size/bs)); e != 0 {
			return fmt.Errorf("/dev/nbd%d: set size: %w", index, e)
		}
		return nil
	}
	return fmt.Errorf("/dev/nbd%d: reattaching needs the kernel's nbd netlink interface (ioctl fallback in use)", index)
}

func (k *Ioctl) Disconnect(index int) error {
	f, err := os.OpenFile(k.path(index), os.O_RDWR, 0)
	if err != nil {
		return err
	}
	_, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), ioDisconnect, 0)
	f.Close()
	if e != 0 {
		return fmt.Errorf("/dev/nbd%d: disconnect: %w", index, e)
	}
	k.mu.Lock()
	run := k.running[index]
	k.mu.Unlock()
	if run != nil {
		<-run.ended
		if run.err != nil {
			return fmt.Errorf("/dev/nbd%d: %w", index, run.err)
		}
	}
	return nil
}

func (k *Ioctl) Status(index int) (Status, error) {
	if _, err := os.Stat(k.path(index)); err != nil {
		return Status{}, err
	}
	return Status{Index: index, Connected: !k.free(index)}, nil
}
