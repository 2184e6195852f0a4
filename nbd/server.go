package nbd

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// ErrServerClosed is returned by Serve and ServeConn after Shutdown.
var ErrServerClosed = errors.New("nbd: server closed")

// Export is one named device the server offers.
type Export struct {
	Name        string
	Description string
	Backend     Backend
	ReadOnly    bool // refuse writes even if the backend accepts them
	// StaleAfter is how long a write may sit in the backend before the
	// client may have sent it again (staleGate): half the kernel's
	// request timeout, or 0 for its default 30 s. The watchdog's 2 s
	// tick makes the hold sure for timeouts of 5 s and more.
	StaleAfter time.Duration
	// Stats, if set, counts the export's requests (metrics, iostat).
	Stats *Stats

	gate *staleGate // set by AddExport
}

// capFlags maps backend capabilities to the flags that advertise them.
var capFlags = []struct {
	c Caps
	f TransmissionFlags
}{
	{CapReadOnly, FlagReadOnly},
	{CapFlush, FlagSendFlush},
	{CapFUA, FlagSendFUA},
	{CapRotational, FlagRotational},
	{CapTrim, FlagSendTrim},
	{CapZeroes, FlagSendWriteZeroes},
	{CapZeroes | CapFastZero, FlagSendFastZero},
	{CapMultiConn, FlagCanMultiConn},
	{CapCache, FlagSendCache},
}

// Flags are the transmission flags for this export. DF is only valid once
// structured replies are negotiated, hence the argument.
func (e *Export) Flags(structured bool) TransmissionFlags {
	c := e.Backend.Caps()
	f := FlagHasFlags
	for _, m := range capFlags {
		if c&m.c == m.c {
			f |= m.f
		}
	}
	if e.ReadOnly {
		f |= FlagReadOnly
	}
	if structured {
		f |= FlagSendDF
	}
	return f
}

// Config tunes a Server. Zero values pick the defaults.
type Config struct {
	Logger *slog.Logger
	// MaxInflight bounds requests read but not yet answered, per
	// connection (default 128, the kernel's queue depth per socket).
	MaxInflight int
	// MaxInflightBytes bounds payload memory per connection (default
	// 128 MiB); one request may always proceed.
	MaxInflightBytes int
	// HandshakeTimeout drops clients that stall during negotiation.
	HandshakeTimeout time.Duration
	// ZeroCopy picks the connections whose large READ replies are
	// spliced instead of copied (default: the kernel's sockets).
	ZeroCopy ZeroCopy
	// SendBuffer is SO_SNDBUF for unix-socket connections (default
	// DefaultSendBuffer; negative keeps the system's). TCP is left to
	// the kernel's autotuning.
	SendBuffer int
	// IdleAfter is how long a connection may wait for a request before
	// its reader parks in the idle watcher instead of holding a thread
	// in read(2) (default DefaultIdleAfter; negative never).
	IdleAfter time.Duration
	// Shared is shared with the other servers of the process (default: a
	// pool of the server's own with DefaultMemoryBudget).
	Shared *Shared
	// NoDirectReplies keeps backends from sending replies from their
	// own threads (see Request.DirectReply): every reply goes through
	// the connection's sender. For comparison and tests.
	NoDirectReplies bool
}

// Server speaks NBD on any number of listeners and connections.
type Server struct {
	cfg  Config
	log  *slog.Logger
	pool *Shared
	// spliced counts READ payload bytes sent by reference (tests read it).
	spliced atomic.Uint64

	mu        sync.Mutex
	exports   map[string]*Export
	order     []*Export
	listeners map[net.Listener]struct{}
	conns     map[*wire]*conn // nil while in the handshake
	closing   bool
	pause     *Paused // the pause in force (handoff.go), if any
	wg        sync.WaitGroup
}

// NewServer returns a server with no exports.
func NewServer(cfg Config) *Server {
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	if cfg.MaxInflight <= 0 {
		cfg.MaxInflight = 128
	}
	if cfg.MaxInflightBytes <= 0 {
		cfg.MaxInflightBytes = 128 << 20
	}
	if cfg.SendBuffer == 0 {
		cfg.SendBuffer = DefaultSendBuffer
	}
	if cfg.IdleAfter == 0 {
		cfg.IdleAfter = DefaultIdleAfter
	}
	if cfg.HandshakeTimeout <= 0 {
		cfg.HandshakeTimeout = 30 * time.Second
	}
	if cfg.Shared == nil {
		cfg.Shared = NewShared(0)
	}
	return &Server{
		cfg:       cfg,
		log:       cfg.Logger,
		pool:      cfg.Shared,
		exports:   map[string]*Export{},
		listeners: map[net.Listener]struct{}{},
		conns:     map[*wire]*conn{},
	}
}

// AddExport offers e. The empty name is the default export.
func (s *Server) AddExport(e Export) error {
	if len(e.Name) > maxStringLen {
		return fmt.Errorf("nbd: export name longer than %d bytes", maxStringLen)
	}
	if e.Backend == nil {
		return errors.New("nbd: export has no backend")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, dup := s.exports[e.Name]; dup {
		return fmt.Errorf("nbd: export %q already exists", e.Name)
	}
	e.gate = &staleGate{after: e.StaleAfter}
	s.exports[e.Name] = &e
	s.order = append(s.order, &e)
	return nil
}

func (s *Server) export(name string) *Export {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.exports[name]
}

func (s *Server) exportList() []*Export {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]*Export(nil), s.order...)
}

func (s *Server) isClosing() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closing
}

// Serve accepts connections on l until Shutdown.
func (s *Server) Serve(l net.Listener) error {
	s.mu.Lock()
	if s.closing {
		s.mu.Unlock()
		l.Close()
		return ErrServerClosed
	}
	s.listeners[l] = struct{}{}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.listeners, l)
		s.mu.Unlock()
	}()
	var backoff time.Duration
	for {
		nc, err := l.Accept()
		if err != nil {
			if s.isClosing() {
				return ErrServerClosed
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() || errors.Is(err, os.ErrDeadlineExceeded) ||
				isTemporaryAccept(err) {
				backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
				s.log.Warn("accept failed, retrying", "err", err, "delay", backoff)
				time.Sleep(backoff)
				continue
			}
			return err
		}
		backoff = 0
		go s.ServeConn(nc)
	}
}

// ServeConn negotiates with a client on nc and serves it until it
// disconnects. It closes nc.
func (s *Server) ServeConn(nc net.Conn) error {
	w := newWire(nc)
	if !s.track(w) {
		nc.Close()
		return ErrServerClosed
	}
	defer s.untrack(w)
	br := bufio.NewReaderSize(nc, 64<<10)
	nc.SetDeadline(time.Now().Add(s.cfg.HandshakeTimeout))
	sess, err := s.negotiate(br, nc)
	if err != nil || sess == nil {
		if err != nil && !errors.Is(err, io.EOF) {
			s.log.Info("nbd handshake ended", "remote", remote(nc), "err", err)
		}
		return err
	}
	return s.transmit(w, br, sess)
}

// ServeNegotiated serves nc, whose handshake happened out of band, with
// the named export: the kernel's sockets are like this (it never
// negotiates; the flags reach it through netlink). It closes nc.
func (s *Server) ServeNegotiated(nc net.Conn, export string) error {
	exp := s.export(export)
	if exp == nil {
		nc.Close()
		return fmt.Errorf("nbd: no export %q", export)
	}
	w := newWire(nc)
	if !s.track(w) {
		nc.Close()
		return ErrServerClosed
	}
	defer s.untrack(w)
	return s.transmit(w, bufio.NewReader(eofReader{}), &session{exp: exp, size: exp.Backend.Size(), followSize: true, kernel: true})
}

type eofReader struct{}

func (eofReader) Read([]byte) (int, error) { return 0, io.EOF }

func (s *Server) transmit(w *wire, br *bufio.Reader, sess *session) error {
	nc := w.nc
	s.mu.Lock()
	if s.closing { // under mu: Shutdown must see the wire it interrupts
		s.mu.Unlock()
		return ErrServerClosed
	}
	r := w.detach(br, s.cfg.IdleAfter)
	if w.unix && s.cfg.SendBuffer > 0 {
		SetSendBuffer(w.fd, s.cfg.SendBuffer)
	}
	c := newConn(s, w, r, sess)
	s.conns[w] = c
	if s.pause != nil {
		// Begun during a pause: it joins it before reading a byte, so
		// no connection escapes a handover.
		s.pause.joinLocked(c)
	}
	s.mu.Unlock()
	s.log.Debug("nbd connection", "remote", remote(nc), "export", sess.exp.Name,
		"structured", sess.structured, "flags", fmt.Sprintf("%#x", uint16(c.tflags)))
	err := c.serve()
	if err != nil && !errors.Is(err, io.EOF) && !s.isClosing() {
		s.log.Info("nbd connection ended", "remote", remote(nc), "err", err)
		return err
	}
	return nil
}

func (s *Server) track(w *wire) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closing {
		return false
	}
	s.conns[w] = nil
	s.wg.Add(1)
	return true
}

func (s *Server) untrack(w *wire) {
	s.mu.Lock()
	delete(s.conns, w)
	w.close()
	if w.released != nil {
		close(w.released)
	}
	s.mu.Unlock()
	s.wg.Done()
}

// Shutdown stops accepting, stops reading new requests, lets requests in
// flight finish and their replies go out, then closes every connection.
// If ctx ends first, connections are closed at once. Backends are the
// caller's to flush and close afterwards.
func (s *Server) Shutdown(ctx context.Context) error {
	s.mu.Lock()
	s.closing = true
	for l := range s.listeners {
		l.Close()
	}
	if s.pause != nil {
		s.pause.endLocked() // paused readers go on, to read the end below
	}
	for w := range s.conns {
		w.stopReading() // wakes the reader; replies still flow
	}
	s.mu.Unlock()
	done := make(chan struct{})
	go func() { s.wg.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		s.mu.Lock()
		for w := range s.conns {
			w.abort()
		}
		s.mu.Unlock()
		return ctx.Err()
	}
}

func remote(nc net.Conn) string {
	if a := nc.RemoteAddr(); a != nil && a.String() != "" {
		return a.String()
	}
	return "local"
}
