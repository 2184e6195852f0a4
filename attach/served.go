package attach

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rbd-nbd-go/rbd-nbd-go/backend"
	"github.com/rbd-nbd-go/rbd-nbd-go/control"
	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
)

// served is one device's userspace half: the open backend and the NBD
// server answering the kernel on our ends of the socketpairs.
type served struct {
	opened *backend.Opened
	srv    *nbd.Server
	conns  sync.WaitGroup // one per connection goroutine
	// live counts the connections being served; idle, if set, runs
	// (and must not block) each time the last of them ends.
	live atomic.Int32
	idle func()
	ends liveEnds // our socket ends, for settleDead
}

// flags are the transmission flags the kernel is told through netlink:
// what the backend can do, minus what the kernel must not send.
func (s *served) flags(rec control.Record) uint64 {
	exp := nbd.Export{Backend: s.opened.Backend, ReadOnly: rec.ReadOnly}
	f := exp.Flags(false)
	if rec.NoTrim {
		f &^= nbd.FlagSendTrim
	}
	if rec.Connections <= 1 {
		f &^= nbd.FlagCanMultiConn
	}
	return uint64(f)
}

// socketpairs returns n pairs: the kernel's ends and ours.
func socketpairs(n int) (kernelEnds, ours []*os.File, err error) {
	for range n {
		fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			closeAll(kernelEnds)
			closeAll(ours)
			return nil, nil, fmt.Errorf("socketpair: %w", err)
		}
		// The kernel sends WRITE payloads through its end: the same
		// window as our replies get, so a 1 MiB write crosses at once.
		nbd.SetSendBuffer(fds[0], nbd.DefaultSendBuffer)
		kernelEnds = append(kernelEnds, os.NewFile(uintptr(fds[0]), "nbd-kernel"))
		ours = append(ours, os.NewFile(uintptr(fds[1]), "nbd-server"))
	}
	return kernelEnds, ours, nil
}

// peerGone reports whether the other end of socket f is closed. Closing
// the last descriptor of a socket releases it before close returns, so
// no wait is needed.
func peerGone(f *os.File) bool {
	sc, err := f.SyscallConn()
	if err != nil {
		return false
	}
	gone := false
	sc.Control(func(fd uintptr) {
		p := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLRDHUP}}
		if n, err := unix.Poll(p, 0); err == nil && n > 0 {
			gone = p[0].Revents&(unix.POLLRDHUP|unix.POLLHUP) != 0
		}
	})
	return gone
}

func closeAll(fs []*os.File) {
	for _, f := range fs {
		f.Close()
	}
}

// newServed opens rec's backend and an NBD server with one export.
func (m *Manager) newServed(rec control.Record, opts backend.Options, stats *nbd.Stats) (*served, error) {
	open := m.cfg.open
	if open == nil {
		open = backend.Open
	}
	opened, err := open(rec.Spec, opts)
	if err != nil {
		return nil, err
	}
	// The server's lines (slow requests, replies the kernel left unread)
	// name the image: they come before the kernel has picked the device.
	srv := nbd.NewServer(nbd.Config{Logger: m.log.With("spec", rec.Spec), Shared: m.shared})
	// A write the kernel may have sent again is held behind its first
	// copy from half the device's timer on: the kernel sends a request
	// again no sooner than one timer after it first sent it.
	stale := rec.IOTimeout / 2
	if rec.IOTimeout == 0 {
		stale = rec.ResendInterval / 2
	}
	if err := srv.AddExport(nbd.Export{Description: opened.Describe, Backend: opened.Backend,
		ReadOnly: rec.ReadOnly, StaleAfter: stale, Stats: stats}); err != nil {
		opened.Close()
		return nil, err
	}
	if rec.Connections > 1 && opened.Backend.Caps()&nbd.CapMultiConn == 0 {
		opened.Close()
		return nil, fmt.Errorf("%s cannot be shared by %d connections", rec.Spec, rec.Connections)
	}
	return &served{opened: opened, srv: srv}, nil
}

// serve answers the kernel on each of our socket ends (it takes them
// all, served or closed). Callers hold the device's lock, as stop's do.
func (s *served) serve(ours []*os.File, log *slog.Logger) error {
	var ncs []net.Conn
	for _, f := range ours {
		nc, err := net.FileConn(f)
		if err != nil {
			closeAll(ours)
			for _, c := range ncs {
				c.Close()
			}
			return err
		}
		ncs = append(ncs, nc)
	}
	for i, nc := range ncs {
		// ours[i] stays open beside the server's copy while the
		// connection is served, for settleDead to look into.
		end := ours[i]
		s.ends.add(end)
		s.conns.Add(1)
		s.live.Add(1)
		go func() {
			defer s.conns.Done()
			if err := s.srv.ServeNegotiated(nc, ""); err != nil && !errors.Is(err, nbd.ErrServerClosed) {
				log.Warn("kernel connection ended", "err", err)
			}
			s.ends.drop(end)
			if s.live.Add(-1) == 0 && s.idle != nil {
				s.idle()
			}
		}()
	}
	return nil
}

// handOff is stop for a handover, whose socket ends have left the
// server: it flushes the backend and releases its exclusive lock, and
// returns the rest of the close, for once the new daemon has the
// device. A backend that cannot release its lock early closes here.
func (s *served) handOff(timeout time.Duration) (closeLater func() error, err error) {
	if err := s.drain(timeout); err != nil {
		// Not known durable: keep the lock until librbd's close has
		// flushed what it can.
		return nil, errors.Join(err, s.opened.Close())
	}
	ok, err := s.opened.ReleaseLock()
	if !ok || err != nil {
		return nil, errors.Join(err, s.opened.Close())
	}
	return s.opened.Close, nil
}

// stop finishes requests in flight (bounded by timeout), flushes and
// closes the backend. The kernel's sockets end with it.
func (s *served) stop(timeout time.Duration) error {
	return errors.Join(s.drain(timeout), s.opened.Close())
}

// drain stops the server, finishing requests in flight (bounded by
// timeout), and flushes the backend.
func (s *served) drain(timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	err := s.srv.Shutdown(ctx)
	// Past the timeout Shutdown aborts the connections without waiting
	// for them; none may still be submitting when the backend closes.
	s.conns.Wait()
	s.ends.closeUnserved()
	return errors.Join(err, nbd.Flush(s.opened.Backend))
}
