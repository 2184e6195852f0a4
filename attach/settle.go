package attach

import (
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Before ReplaceDead hands the kernel a new socket for a dead one, the
// kernel must have read everything we sent on the dead one.
//
// Linux's nbd driver (6.1; drivers/block/nbd.c, recv_work and
// sock_xmit) runs one receive worker per connection slot, and that
// worker reads whatever socket the slot holds at each read. A timed-out
// socket is shut down, but its worker keeps reading the replies already
// queued on it, and exits only at the read that finds it empty. If
// RECONFIGURE (nbd_reconnect_socket, which does not wait for the old
// worker) puts the new socket in the slot meanwhile, the old worker reads
// the new socket beside its new worker: two readers splitting one
// stream. The kernel then logged "Wrong magic (0xffffffff)", and a READ
// reply's bytes could go to another request. So ReplaceDead first waits
// until each dead socket holds nothing unread (SIOCOUTQ on our end: our
// bytes the peer has not consumed), then a moment for the worker's last
// read. Not covered: a reattach after a restart, whose predecessor's
// ends are closed with its process, so there is nothing left to ask.

// Bounds of settleDead: how long the kernel may take to read what is
// queued on a dead socket (past it, a worker that stopped reading has
// ended anyway), and the moment given to the worker's last read.
const (
	settleMax   = 2 * time.Second
	settleGrace = 50 * time.Millisecond
	settlePoll  = 5 * time.Millisecond
)

// liveEnds are a device's socket ends: kept open beside the NBD
// server's copies while their connections are served, and past that
// while the kernel has shut the socket down and settleDead has not seen
// it read empty yet. (Our connection to a dead socket ends at once when
// nothing is in flight; the kernel's worker may still be reading.)
// Keeping our end of such a socket open changes nothing for the kernel:
// its end is shut down, its worker reads EOF once the queue is empty.
type liveEnds struct {
	mu sync.Mutex
	m  map[*os.File]*endState
}

type endState struct {
	served  bool // its connection is being served
	settled bool // settleDead saw it read empty (or gave up)
}

func (l *liveEnds) add(f *os.File) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.m == nil {
		l.m = map[*os.File]*endState{}
	}
	l.m[f] = &endState{served: true}
}

// drop is called when f's connection ends: f is closed, unless the
// kernel shut it down and it is yet to be settled.
func (l *liveEnds) drop(f *os.File) {
	l.mu.Lock()
	defer l.mu.Unlock()
	e := l.m[f]
	if e == nil {
		f.Close()
		return
	}
	e.served = false
	if e.settled || !peerGone(f) {
		delete(l.m, f)
		f.Close()
	}
}

// dead lists the ends the kernel has shut down, not yet settled.
func (l *liveEnds) dead() []*os.File {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []*os.File
	for f, e := range l.m {
		if !e.settled && peerGone(f) {
			out = append(out, f)
		}
	}
	return out
}

// settled marks fs settled, closing those no longer served.
func (l *liveEnds) settled(fs []*os.File) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, f := range fs {
		if e := l.m[f]; e != nil {
			e.settled = true
			if !e.served {
				delete(l.m, f)
				f.Close()
			}
		}
	}
}

// closeUnserved closes the ends kept past their connections (the device
// is no longer served).
func (l *liveEnds) closeUnserved() {
	l.mu.Lock()
	defer l.mu.Unlock()
	for f, e := range l.m {
		if !e.served {
			delete(l.m, f)
			f.Close()
		}
	}
}

// settleDead waits, up to max, until the kernel has read everything
// queued on each socket of the device it shut down, then grace more.
// It returns how long it waited and whether everything was read (true
// when there was no such socket).
func (s *served) settleDead(max, grace time.Duration) (time.Duration, bool) {
	dead := s.ends.dead()
	if len(dead) == 0 {
		return 0, true
	}
	defer s.ends.settled(dead)
	t0 := time.Now()
	deadline := t0.Add(max)
	drained := false
	for !drained && time.Now().Before(deadline) {
		drained = true
		for _, f := range dead {
			if unread(f) > 0 {
				drained = false
			}
		}
		if !drained {
			time.Sleep(settlePoll)
		}
	}
	time.Sleep(grace)
	return time.Since(t0), drained
}

// unread is how many bytes we sent on f that its peer has not read yet;
// 0 once f is closed.
func unread(f *os.File) int {
	sc, err := f.SyscallConn()
	if err != nil {
		return 0
	}
	n := 0
	if err := sc.Control(func(fd uintptr) {
		n, _ = unix.IoctlGetInt(int(fd), unix.SIOCOUTQ)
	}); err != nil {
		return 0
	}
	return n
}
