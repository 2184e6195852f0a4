package kernel

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"syscall"

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

// Ioctl is the fallback Controller for kernels without the genl family.
// NBD_DO_IT blocks for the device's whole life, so each device keeps one
// locked OS thread in this process; the device goes when the process does.
type Ioctl struct {
	devDir, sysDir string

	mu      sync.Mutex
	running map[int]chan error // NBD_DO_IT's result, per device
}

// NewIoctl drives /dev/nbdN through ioctls.
func NewIoctl() *Ioctl {
	return &Ioctl{devDir: "/dev", sysDir: "/sys/block", running: map[int]chan error{}}
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

func (k *Ioctl) Connect(cfg Config, socks []*os.File) (int, error) {
	if len(socks) == 0 || cfg.Size == 0 {
		return 0, errors.New("connect: need sockets and a size")
	}
	index := cfg.Index
	k.mu.Lock()
	defer k.mu.Unlock()
	if index == AnyIndex {
		for i := 0; ; i++ {
			if _, err := os.Stat(k.path(i)); err != nil {
				return 0, errors.New("no free /dev/nbdN device (raise --nbds_max)")
			}
			if _, busy := k.running[i]; !busy && k.free(i) {
				index = i
				break
			}
		}
	} else if _, busy := k.running[index]; busy || !k.free(index) {
		return 0, fmt.Errorf("/dev/nbd%d is busy (already connected)", index)
	}
	f, err := os.OpenFile(k.path(index), os.O_RDWR, 0)
	if err != nil {
		return 0, err
	}
	// The kernel binds a device to the thread that sets its first
	// socket ("being setup by another task" otherwise): setup and
	// NBD_DO_IT all run on one locked thread, which then serves the
	// device for its whole life.
	setup := make(chan error, 1)
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		if err := k.setup(f.Fd(), index, cfg, socks); err != nil {
			f.Close()
			setup <- err
			return
		}
		setup <- nil
		_, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), ioDoIt, 0)
		unix.Syscall(unix.SYS_IOCTL, f.Fd(), ioClearSock, 0)
		f.Close()
		k.mu.Lock()
		delete(k.running, index)
		k.mu.Unlock()
		if e != 0 && e != syscall.EPIPE {
			done <- e
		}
		close(done)
	}()
	if err := <-setup; err != nil {
		return 0, err
	}
	k.running[index] = done
	return index, nil
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
	done := k.running[index]
	k.mu.Unlock()
	if done != nil {
		if err := <-done; err != nil {
			return fmt.Errorf("/dev/nbd%d: %w", index, err)
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
