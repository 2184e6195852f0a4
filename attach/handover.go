package attach

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sort"
	"sync"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/control"
	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
)

// Handover: passing every device to a new daemon process (an upgrade)
// without the kernel ever seeing a dead connection. The kernel re-sends
// a request the old server read but did not answer only when its timer
// fires (30 s), so a restart that drops sockets stalls every volume for
// that long. Instead the old daemon stops reading each socket at a
// request boundary, answers everything it read, flushes its images and
// releases their exclusive locks, and gives its socket ends to the new
// daemon, which takes the locks and reads on; the old one closes the
// images after that. The two never read one socket, nor hold one image
// for writing, at the same time.

// Handed is one device as it passes to the new daemon: its record and
// our ends of its kernel sockets (none for a detached device).
type Handed struct {
	Rec   control.Record
	Conns []*os.File
}

// Handover is the old daemon's side, from the moment every device is
// paused until Release or Abort. It holds every device's lock
// meanwhile, so no map, unmap, resize or reattach runs across it.
type Handover struct {
	m      *Manager
	devs   []*device
	paused []*nbd.Paused // per device; nil for a detached one
	done   bool
	// later: per device, what is left of closing its released backend
	// (nil if none is).
	later []func() error
}

// HandOver pauses every served device: no socket is read any more, and
// every request read has been answered. If ctx ends first (a request
// stuck in the backend), everything is resumed and the error returned:
// the daemon goes on serving as if nothing happened.
func (m *Manager) HandOver(ctx context.Context) (*Handover, error) {
	m.mu.Lock()
	devs := make([]*device, 0, len(m.devs))
	for _, d := range m.devs {
		devs = append(devs, d)
	}
	m.mu.Unlock()
	// One order for everyone who takes several device locks.
	sort.Slice(devs, func(i, j int) bool { return devs[i].rec.Index < devs[j].rec.Index })
	for _, d := range devs {
		d.mu.Lock()
	}
	h := &Handover{m: m, devs: devs, paused: make([]*nbd.Paused, len(devs))}
	errs := make([]error, len(devs))
	var wg sync.WaitGroup
	for i, d := range devs {
		if d.s == nil {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			h.paused[i], errs[i] = d.s.srv.Pause(ctx)
			if errs[i] != nil {
				errs[i] = fmt.Errorf("%s: %w", d.rec.Device(), errs[i])
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		h.Abort()
		return nil, fmt.Errorf("pause for handover: %w", err)
	}
	return h, nil
}

// Abort resumes every paused device: the handover did not happen.
func (h *Handover) Abort() {
	if h.done {
		return
	}
	h.done = true
	for i, p := range h.paused {
		if p != nil {
			p.Resume()
		}
		h.devs[i].mu.Unlock()
	}
}

// Release takes our socket ends out of the NBD servers, flushes every
// backend and releases its lock (the image is free for the new daemon
// once this returns) and forgets every device; their records stay in
// the store for the new daemon. The rest of each backend's close waits
// for CloseReleased. Errors are returned but do not stop the handover:
// every request was answered, with librbd's word that what it
// acknowledged is durable, and a backend whose lock could not be
// released early was closed.
func (h *Handover) Release() ([]Handed, error) {
	if h.done {
		return nil, errors.New("handover already ended")
	}
	h.done = true
	out := make([]Handed, len(h.devs))
	errs := make([]error, len(h.devs))
	h.later = make([]func() error, len(h.devs))
	var wg sync.WaitGroup
	for i, d := range h.devs {
		out[i].Rec = d.rec
		if d.s == nil {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			handed, err := h.paused[i].Release()
			for _, c := range handed {
				out[i].Conns = append(out[i].Conns, c.File)
			}
			later, herr := d.s.handOff(30 * time.Second)
			d.s = nil
			h.later[i] = later
			errs[i] = errors.Join(err, herr)
			if errs[i] != nil {
				errs[i] = fmt.Errorf("%s: %w", d.rec.Device(), errs[i])
			}
		}()
	}
	wg.Wait()
	h.m.mu.Lock()
	for _, d := range h.devs {
		if h.m.devs[d.rec.Index] == d {
			delete(h.m.devs, d.rec.Index)
		}
	}
	h.m.mu.Unlock()
	for _, d := range h.devs {
		d.mu.Unlock()
	}
	return out, errors.Join(errs...)
}

// CloseReleased finishes closing the backends Release let go of. The
// old daemon calls it once the new one has the devices, so that the
// closes' round trips to the cluster stay out of the devices' pause.
func (h *Handover) CloseReleased() error {
	errs := make([]error, len(h.later))
	fanOut(len(h.later), func(i int) {
		if h.later[i] != nil {
			errs[i] = h.later[i]()
		}
	})
	h.later = nil
	return errors.Join(errs...)
}

// adoptWidth bounds the images opened at once by Adopt: each open is a
// few round trips to the cluster, and the devices stall until theirs is
// done.
const adoptWidth = 8

// Adopt is the new daemon's side: it opens each handed device's backend
// (or takes the one prepared ahead, if any), takes its lock, which the
// old daemon released, and serves the sockets it was given, with no
// RECONFIGURE: the kernel never saw them change hands. A device whose
// backend does not open has its sockets closed, so the kernel marks them
// dead and Restore's reattach takes it back the usual way; those errors
// are returned. Whatever of prep Adopt does not use, it closes.
func (m *Manager) Adopt(handed []Handed, prep *Prepared) error {
	defer prep.Close()
	errs := make([]error, len(handed))
	var todo []int
	for i, h := range handed {
		if len(h.Conns) == 0 {
			rec := h.Rec
			rec.Detached = true
			m.mu.Lock()
			m.devs[rec.Index] = newDevice(rec)
			m.mu.Unlock()
			continue
		}
		todo = append(todo, i)
	}
	fanOut(len(todo), func(j int) {
		h := handed[todo[j]]
		if err := m.adopt(h, prep); err != nil {
			closeAll(h.Conns)
			errs[todo[j]] = fmt.Errorf("adopt %s: %w", h.Rec.Device(), err)
		}
	})
	return errors.Join(errs...)
}

// fanOut runs do(0..n-1), adoptWidth at a time, and waits for them all.
func fanOut(n int, do func(i int)) {
	sem := make(chan struct{}, adoptWidth)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			do(i)
		}()
	}
	wg.Wait()
}

// openServed opens rec's backend and server for a device not yet
// registered; deferred leaves the lock and quiesce watch to Activate.
func (m *Manager) openServed(rec control.Record, deferred bool) (*device, *served, error) {
	rec, err := m.withPassphrase(rec)
	if err != nil {
		return nil, nil, err
	}
	d := newDevice(rec)
	opts := m.backendOptions(d)
	opts.Deferred = deferred
	s, err := m.newServed(rec, opts, d.stats)
	if err != nil {
		return nil, nil, err
	}
	m.watchIdle(d, s)
	d.mu.Lock()
	d.rec, err = m.keepPassphrase(d.rec)
	d.mu.Unlock()
	if err != nil {
		s.stop(5 * time.Second)
		return nil, nil, err
	}
	return d, s, nil
}

func (m *Manager) adopt(h Handed, prep *Prepared) error {
	t0 := time.Now()
	d, s := prep.take(h.Rec)
	ahead := s != nil
	if !ahead {
		var err error
		if d, s, err = m.openServed(h.Rec, false); err != nil {
			return err
		}
	} else if err := s.opened.Activate(); err != nil {
		s.stop(5 * time.Second)
		return err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	m.mu.Lock()
	if m.devs[h.Rec.Index] != nil {
		m.mu.Unlock()
		s.stop(5 * time.Second)
		return fmt.Errorf("%s is already served here", h.Rec.Device())
	}
	d.s = s
	m.devs[h.Rec.Index] = d
	m.mu.Unlock()
	if err := s.serve(h.Conns, m.log); err != nil {
		m.drop(h.Rec.Index)
		d.s = nil
		s.stop(5 * time.Second)
		return err
	}
	m.log.Info("adopted from the previous daemon", "device", h.Rec.Device(), "spec", h.Rec.Spec,
		"connections", len(h.Conns), "opened_ahead", ahead, "took", time.Since(t0).Round(time.Millisecond))
	return nil
}
