package nbd

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// Handing live connections over. A rolling upgrade of the node daemon
// must move the daemon's ends of the kernel's sockets to the new daemon
// without the kernel ever seeing a dead connection: it would fail the
// device's I/O, or at best wait for its 30 s request timer to fire and
// send the request again. For the same reason no request may be lost in
// the move (a 30 s stall), split (the new daemon would read the middle
// of a message as a header: the stream is lost), or read twice (a WRITE
// applied again after later ones reorders the disk's contents).
//
// So the old server first pauses: every connection's reader stops at a
// request boundary, with nothing of the next request read and nothing
// left in its read buffer, and every request it read is answered, its
// reply whole in the socket. What is then in the socket is the kernel's
// business only: requests it sent since, which whoever reads next
// serves. From there the server either resumes, as if nothing had
// happened (the handover was refused, or the new daemon failed), or
// releases: it gives each socket away as a duplicate and closes its own
// descriptors without shutdown(2), so the socket stays open in the
// duplicate and the peer never sees an end of file.

var (
	// ErrPaused is returned by Pause while another pause is in force.
	ErrPaused = errors.New("nbd: server already paused")
	// errPauseOver: Resume or Release on a pause already resumed.
	errPauseOver = errors.New("nbd: pause already over")
	// errPausePoint: the reader stopped at a request boundary for a
	// pause, with nothing of the next request read.
	errPausePoint = errors.New("nbd: reader stopped for a pause")
	// errHandedOff: the connection was released to another server.
	errHandedOff = errors.New("nbd: connection handed over")
)

// Handed is a socket Release gave away: a duplicate of the server's
// descriptor (now closed) and the export it served. Serve it on with
// ServeNegotiated(net.FileConn(File), Export), in this process or
// another one (SCM_RIGHTS), and close File.
type Handed struct {
	File   *os.File
	Export string
}

// Paused is a Server whose connections read nothing until Resume or
// Release. Connections that begin transmission meanwhile join the pause
// before they read a byte.
type Paused struct {
	s       *Server
	changed chan struct{} // capacity 1: a connection's state moved
	conns   []*connPause  // under s.mu
	over    bool          // under s.mu: resumed, released or ended by Shutdown
}

// connPause is one connection's part in a pause.
type connPause struct {
	p       *Paused
	c       *conn
	stopped bool  // under c.mu: the reader waits at a request boundary
	verdict uint8 // under c.mu
}

const (
	verdictNone uint8 = iota
	verdictResume
	verdictRelease
)

// Pause stops every connection of s from reading, each at a request
// boundary: a request partly read (its header, or a WRITE's payload) is
// read to its end and submitted, and requests already read ahead into
// the read buffer are served, before the reader stops. Pause then waits
// until every request read has been answered and its reply written to
// the socket, whichever way it went out (the sender, a backend's direct
// reply, a spliced or lent payload). Nothing is ever shut down.
//
// If ctx ends first, or Shutdown comes, every connection reads on and
// Pause returns the error: no connection is left paused.
//
// A reader blocked in read(2) on a quiet socket notices the pause when
// its IdleAfter runs out (it would park in the idle watcher, which a
// pause wakes): with IdleAfter negative it notices only when the next
// request arrives, so Pause may then wait for that or for ctx.
func (s *Server) Pause(ctx context.Context) (*Paused, error) {
	s.mu.Lock()
	if s.closing {
		s.mu.Unlock()
		return nil, ErrServerClosed
	}
	if s.pause != nil {
		s.mu.Unlock()
		return nil, ErrPaused
	}
	p := &Paused{s: s, changed: make(chan struct{}, 1)}
	s.pause = p
	for _, c := range s.conns {
		if c != nil {
			p.joinLocked(c)
		}
	}
	s.mu.Unlock()
	if err := p.wait(ctx); err != nil {
		p.Resume()
		return nil, err
	}
	return p, nil
}

// joinLocked asks c to pause (s.mu held).
func (p *Paused) joinLocked(c *conn) {
	cp := &connPause{p: p, c: c}
	p.conns = append(p.conns, cp)
	c.mu.Lock()
	c.pz = cp
	c.pausing.Store(true)
	c.mu.Unlock()
	select { // wake it if it is parked idle (set after pausing: see park)
	case c.nudge <- struct{}{}:
	default:
	}
	if c.w.fd < 0 {
		// A reader of the net.Conn blocks in the netpoller: a deadline
		// wakes it, perhaps mid-message (see interrupted).
		c.w.nc.SetReadDeadline(time.Unix(1, 0))
	}
}

// wait returns once every connection of p is stopped and drained, or
// has ended.
func (p *Paused) wait(ctx context.Context) error {
	for {
		p.s.mu.Lock()
		over, ready := p.over, p.readyLocked()
		p.s.mu.Unlock()
		switch {
		case over:
			return ErrServerClosed // only Shutdown ends a pause not yet returned
		case ready:
			return nil
		}
		select {
		case <-p.changed:
		case <-ctx.Done():
			return fmt.Errorf("nbd: pause: connections not drained: %w", ctx.Err())
		}
	}
}

// readyLocked (s.mu held). A request returns to free only once its reply
// is written whole: by the sender (release), or by a backend that sent
// it directly and then finished it with Sent.
func (p *Paused) readyLocked() bool {
	for _, cp := range p.conns {
		c := cp.c
		c.mu.Lock()
		ok := c.readDone || cp.stopped && len(c.free) == len(c.all)
		c.mu.Unlock()
		if !ok {
			return false
		}
	}
	return true
}

func (p *Paused) notify() {
	select {
	case p.changed <- struct{}{}:
	default:
	}
}

// Resume lets every connection read on, as if there had been no pause.
// It does nothing once the pause is over (resumed, released, or ended
// by Shutdown).
func (p *Paused) Resume() {
	p.s.mu.Lock()
	defer p.s.mu.Unlock()
	p.endLocked()
}

// endLocked resumes every connection (s.mu held).
func (p *Paused) endLocked() {
	if p.over {
		return
	}
	p.over = true
	p.s.pause = nil
	for _, cp := range p.conns {
		cp.give(verdictResume)
	}
	p.notify()
}

// give tells c's reader what becomes of it (s.mu held).
func (cp *connPause) give(v uint8) {
	c := cp.c
	c.mu.Lock()
	cp.verdict = v
	if c.pz == cp && v == verdictResume {
		// Released, it stays paused for good: its reader must not
		// read another byte of a socket that is no longer ours.
		c.pz = nil
		c.pausing.Store(false)
	}
	c.mu.Unlock()
	c.cond.Broadcast()
	if v == verdictResume && c.w.fd < 0 && !cp.p.s.closing {
		c.w.nc.SetReadDeadline(time.Time{}) // joinLocked's; Shutdown's stays
	}
}

// Release ends the pause by giving every connection away: it returns a
// duplicate of each socket and closes the server's own descriptors
// without shutdown(2), so the peer sees no end of file while the
// duplicate lives; the socket's receive timeout (IdleAfter) is cleared
// first, leaving it as it came. The server is then closed, as after
// Shutdown. Connections that ended meanwhile are not handed.
//
// Only connections served by ServeNegotiated on a socket can go: a new
// server continues them with ServeNegotiated, which would not know what
// a handshake negotiated. If any other is open, Release fails and the
// pause stays in force (Resume it). Release returns once the server's
// copies are closed; as at any connection's end, a lent payload the
// peer has not read yet holds that up, for loanDrainWait at most.
func (p *Paused) Release() ([]Handed, error) {
	s := p.s
	for {
		// Connections that joined after Pause returned may not have
		// reached their first boundary yet (they have read nothing, so
		// they do at once).
		p.wait(context.Background()) // its only error: the pause is over
		s.mu.Lock()
		if p.over {
			closing := s.closing
			s.mu.Unlock()
			if closing {
				return nil, ErrServerClosed
			}
			return nil, errPauseOver
		}
		if p.readyLocked() {
			break // with s.mu
		}
		s.mu.Unlock()
	}
	var take []*connPause
	for _, cp := range p.conns {
		c := cp.c
		c.mu.Lock()
		live := !c.readDone
		c.mu.Unlock()
		if !live {
			continue
		}
		if !c.kernel || c.w.fd < 0 {
			s.mu.Unlock()
			return nil, fmt.Errorf("nbd: cannot hand over the connection from %s: only ServeNegotiated sockets can be", remote(c.w.nc))
		}
		take = append(take, cp)
	}
	hs := make([]Handed, 0, len(take))
	for _, cp := range take {
		// Under s.mu, which untrack takes to close it: fd is ours.
		fd, err := unix.FcntlInt(uintptr(cp.c.w.fd), unix.F_DUPFD_CLOEXEC, 0)
		if err != nil {
			s.mu.Unlock()
			for _, h := range hs {
				h.File.Close()
			}
			return nil, os.NewSyscallError("fcntl", err)
		}
		hs = append(hs, Handed{File: os.NewFile(uintptr(fd), "nbd"), Export: cp.c.exp.Name})
	}
	// Committed: from here on nothing fails.
	var none unix.Timeval
	for _, cp := range take {
		w := cp.c.w
		unix.SetsockoptTimeval(w.fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &none)
		w.handed.Store(true) // stopReading and abort leave it alone
		w.released = make(chan struct{})
	}
	s.closing = true
	p.over = true
	s.pause = nil
	for l := range s.listeners {
		l.Close()
	}
	for w := range s.conns {
		w.stopReading() // handshakes in progress; the handed are exempt
	}
	for _, cp := range p.conns {
		v := verdictResume // ended already: let it finish closing
		if cp.c.w.handed.Load() {
			v = verdictRelease
		}
		cp.give(v)
	}
	p.notify()
	s.mu.Unlock()
	for _, cp := range take {
		<-cp.c.w.released
	}
	return hs, nil
}

// atBoundary: nothing of the next request is read (reader only).
func (c *conn) atBoundary() bool {
	return c.br.Buffered() == 0 && (c.w.rest == nil || c.w.rest.Len() == 0)
}

// pausePoint holds the reader, at a request boundary, for as long as a
// pause is in force; errHandedOff if the connection was released.
// Meanwhile it sends what its own Submit calls completed and keeps the
// backend finishing direct replies at once (Waiting), so the pause
// drains without a reader that would otherwise prompt both.
func (c *conn) pausePoint() error {
	c.mu.Lock()
	paused := c.pz != nil
	c.mu.Unlock()
	if !paused {
		return nil // over before it got here
	}
	c.kick()
	c.waiting(true)
	defer c.waiting(false)
	c.mu.Lock()
	for c.pz != nil {
		cp := c.pz
		cp.stopped = true
		for cp.verdict == verdictNone {
			cp.p.notify() // woken by each request's return
			c.cond.Wait()
		}
		if cp.verdict == verdictRelease {
			c.mu.Unlock()
			return errHandedOff
		}
		// Resumed; c.pz may already be the next pause.
	}
	c.mu.Unlock()
	select { // a stale nudge would only cost a spurious wake-up
	case <-c.nudge:
	default:
	}
	return nil
}

// readEnded records that the reader returned, so that a pause does not
// wait for it.
func (c *conn) readEnded() {
	c.mu.Lock()
	c.readDone = true
	cp := c.pz
	c.mu.Unlock()
	if cp != nil {
		cp.p.notify()
	}
}

// interrupted judges a read error of the reader: nil when a pause's
// deadline cut a message short (the deadline is then cleared and the
// read goes on: a message is never left half read), errPausePoint when
// it stopped the reader at a boundary, err otherwise (Shutdown's
// deadline included). Only a reader of the net.Conn (no descriptor of
// its own) has deadlines; deadlines are set and cleared under s.mu.
func (c *conn) interrupted(err error, boundary bool) error {
	if c.w.fd >= 0 || !errors.Is(err, os.ErrDeadlineExceeded) {
		return err
	}
	s := c.srv
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.closing:
		return err
	case boundary && c.pausing.Load():
		return errPausePoint // the deadline stays until the pause ends
	}
	c.w.nc.SetReadDeadline(time.Time{})
	return nil
}
