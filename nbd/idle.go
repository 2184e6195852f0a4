package nbd

import (
	"errors"
	"io"
	"os"
	"runtime"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// DefaultIdleAfter is how long a connection's reader waits in read(2)
// before it parks in the idle watcher (see idleWatcher).
const DefaultIdleAfter = 500 * time.Millisecond

// An idleWatcher parks the readers of idle connections: one goroutine in
// epoll_wait for all of them, so an idle connection costs no OS thread.
//
// Busy connections keep reading in blocking read(2) on a descriptor
// outside Go's netpoller (see wire), which is what makes the reader
// cheap at 100k requests/s. That costs a thread per connection for as
// long as it blocks: with thousands of connections on a node (devices ×
// connections) the daemon's threads and their stacks would grow with
// them. So the socket gets SO_RCVTIMEO: a read that waits longer than
// IdleAfter returns EAGAIN, the reader registers the socket here (one
// shot, level-triggered: data that came meanwhile wakes it at once),
// parks on a channel, and its thread is ended (releaseThread): the Go
// runtime never ends an idle thread, so without that the daemon would
// keep as many threads as readers were ever blocked at once. The first
// byte that arrives wakes the reader, which goes back to blocking reads
// (on a thread the scheduler gives it). A busy connection never reaches
// the timeout and pays nothing.
//
// Ending threads keeps the no-reclaim-deadlock rule: PF_MEMALLOC_NOIO
// (PR_SET_IO_FLUSHER) is inherited at clone, so the threads the runtime
// makes later have it like every thread before them. (A VM check once
// reported a thread without it; that check read each thread's flags
// after listing the threads, so a thread that ended in between read as
// flagless. It now skips threads that are gone.)
type idleWatcher struct {
	mu      sync.Mutex
	epfd    int // valid while running
	running bool
	next    uint64
	waiters map[uint64]idleWaiter
}

type idleWaiter struct {
	fd int
	ch chan struct{}
}

// wait returns once fd is readable (or hung up, or shut down: the read
// that follows tells which), or once cancel (nil: never) is readable:
// then fd is watched no more and cancelled is true.
func (iw *idleWatcher) wait(fd int, cancel <-chan struct{}) (cancelled bool, err error) {
	ch := make(chan struct{})
	iw.mu.Lock()
	if !iw.running {
		epfd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
		if err != nil {
			iw.mu.Unlock()
			return false, os.NewSyscallError("epoll_create1", err)
		}
		iw.epfd, iw.running = epfd, true
		if iw.waiters == nil {
			iw.waiters = map[uint64]idleWaiter{}
		}
		go iw.loop(epfd)
	}
	id := iw.next
	iw.next++
	iw.waiters[id] = idleWaiter{fd, ch}
	ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLRDHUP | unix.EPOLLONESHOT,
		Fd: int32(id), Pad: int32(id >> 32)}
	// Registered under the lock: the loop closes epfd only when no
	// waiter is left, and ours is not gone until it fired (or was
	// cancelled, under the lock too).
	err = unix.EpollCtl(iw.epfd, unix.EPOLL_CTL_ADD, fd, &ev)
	if err != nil {
		delete(iw.waiters, id)
		iw.mu.Unlock()
		return false, os.NewSyscallError("epoll_ctl", err)
	}
	iw.mu.Unlock()
	releaseThread()
	select {
	case <-ch:
		return false, nil
	case <-cancel:
	}
	// Unregistered before the caller goes on: it may hand fd to another
	// process and close it, and a registration left behind would fire
	// for the new owner's data. If the loop got there first, this was
	// an ordinary wake-up. (With no waiter left the loop still waits
	// for the next registration's event: one goroutine, as while
	// anyone was parked.)
	iw.mu.Lock()
	defer iw.mu.Unlock()
	if _, ok := iw.waiters[id]; !ok {
		return false, nil
	}
	unix.EpollCtl(iw.epfd, unix.EPOLL_CTL_DEL, fd, nil)
	delete(iw.waiters, id)
	return true, nil
}

// releaseThread ends the OS thread that ran the goroutine which is about
// to park: the goroutine started here runs next on it (runnext), locks
// itself to the thread and exits, and the runtime ends a thread whose
// locked goroutine exits.
func releaseThread() {
	go runtime.LockOSThread()
}

// loop wakes the waiters whose sockets became readable, removing each
// socket from the set before the waiter can go on (and later close it),
// and ends, closing epfd, when nobody waits.
func (iw *idleWatcher) loop(epfd int) {
	events := make([]unix.EpollEvent, 64)
	for {
		n, err := unix.EpollWait(epfd, events, -1)
		if err != nil && err != unix.EINTR {
			// Cannot happen with a valid epfd; wake everyone, whose
			// reads then block as before.
			iw.mu.Lock()
			for id, w := range iw.waiters {
				delete(iw.waiters, id)
				close(w.ch)
			}
			iw.running = false
			unix.Close(epfd)
			iw.mu.Unlock()
			return
		}
		iw.mu.Lock()
		for _, ev := range events[:max(n, 0)] { // n is -1 on EINTR
			id := uint64(uint32(ev.Fd)) | uint64(uint32(ev.Pad))<<32
			if w, ok := iw.waiters[id]; ok {
				// Removed while its waiter is parked, so fd is still
				// open: the waiter may register it again, or close it.
				unix.EpollCtl(epfd, unix.EPOLL_CTL_DEL, w.fd, nil)
				delete(iw.waiters, id)
				close(w.ch)
			}
		}
		if len(iw.waiters) == 0 {
			iw.running = false
			unix.Close(epfd) // removes every registration with it
			iw.mu.Unlock()
			return
		}
		iw.mu.Unlock()
	}
}

// errIdle is what a read of a detached socket returns when nothing came
// for IdleAfter: the reader should park (conn.park), not fail.
var errIdle = errors.New("nbd: connection idle")

// fdReader reads a detached socket whose SO_RCVTIMEO is set.
type fdReader int

func (r fdReader) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	for {
		n, err := unix.Read(int(r), p)
		switch {
		case err == nil && n == 0:
			return 0, io.EOF
		case err == nil:
			return n, nil
		case errors.Is(err, unix.EINTR):
		case errors.Is(err, unix.EAGAIN):
			return 0, errIdle
		default:
			return 0, os.NewSyscallError("read", err)
		}
	}
}
