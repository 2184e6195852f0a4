package attach

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
	"github.com/rbd-nbd-go/rbd-nbd-go/control"
	"github.com/rbd-nbd-go/rbd-nbd-go/devspec"
	"github.com/rbd-nbd-go/rbd-nbd-go/kernel"
)

// Reattach: serving a device the kernel still has again (after Detach, a
// restart of this process, or a dead connection), and Restore after a
// restart.

// Detach stops serving a device but leaves it in the kernel, waiting up
// to its reattach timeout for Attach.
func (m *Manager) Detach(target string) error {
	d, err := m.lockTarget(target)
	if err != nil {
		return err
	}
	defer d.mu.Unlock()
	err = d.stopServing()
	m.mu.Lock()
	d.rec.Detached = true
	rec := d.rec
	m.mu.Unlock()
	return errors.Join(err, m.cfg.Store.Save(rec))
}

// Attach serves an existing kernel device again (after Detach, or after
// this process restarted): new sockets replace the dead ones through
// RECONFIGURE, which the kernel only accepts with the device's cookie.
// Attaching a device that is already served with the same spec and
// cookie is a no-op. As for Map, rec has been validated by the caller:
// the control server, or Restore.
func (m *Manager) Attach(rec control.Record) (control.Record, error) {
	t0 := time.Now()
	rec.Defaults()
	if rec.Index < 0 {
		return control.Record{}, errors.New("attach needs a device index")
	}
	var old *device // a detached device's counters carry on
	if d := m.get(rec.Index); d != nil {
		old = d
		d.mu.Lock()
		cur := d.rec
		live := d.s != nil
		d.mu.Unlock()
		if !sameSpec(cur.Spec, rec.Spec) || (rec.Cookie != "" && cur.Cookie != rec.Cookie) {
			return control.Record{}, fmt.Errorf("%s is mapped to %s (cookie %s)", cur.Device(), cur.Spec, cur.Cookie)
		}
		if live {
			return cur, nil
		}
		// Reattach a detached device with its recorded options; the
		// caller's credentials win (they may be fresher).
		rec = mergeAttach(cur, rec)
		m.drop(rec.Index)
	}
	st, err := m.cfg.Kernel.Status(rec.Index)
	if err != nil {
		return control.Record{}, fmt.Errorf("%s: %w", rec.Device(), err)
	}
	if !st.Connected {
		return control.Record{}, fmt.Errorf("%s is not connected in the kernel (use map)", rec.Device())
	}
	rec.Detached = false
	if rec, err = m.withPassphrase(rec); err != nil {
		return control.Record{}, err
	}
	d := newDevice(rec)
	if old != nil {
		d.stats, d.events = old.stats, old.events
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	// With NBD's own timeout off, the kernel never gives up on a request
	// nobody answers, nor shuts its socket: it sends again what the dead
	// server had read when the request's timer next fires after the
	// socket was replaced (every resend interval: 2 s for CSI maps). So
	// the new sockets go to the kernel first, and that wait runs while
	// the image opens (Deferred), is fenced and locked, instead of after.
	// Not one request is read before Activate, so nothing reaches the
	// image first; if the open or the lock fails our ends close unread
	// and the kernel keeps its requests for the next attach. With an
	// io-timeout the kernel would time out what sits unread, so the
	// image is opened and locked before the sockets change, as before.
	first := rec.IOTimeout == 0
	var ours []*os.File
	var opened, handed, locked time.Duration
	t := time.Now()
	lap := func(d *time.Duration) { *d = time.Since(t); t = time.Now() }
	if first {
		if ours, err = m.reattach(&d.rec, 0); err != nil {
			return control.Record{}, err
		}
		lap(&handed)
	}
	opts := m.backendOptions(d)
	opts.Deferred = first
	s, err := m.newServed(d.rec, opts, d.stats)
	if err != nil {
		closeAll(ours)
		return control.Record{}, err
	}
	m.watchIdle(d, s)
	lap(&opened)
	fail := func(err error) (control.Record, error) {
		closeAll(ours)
		s.stop(5 * time.Second)
		return control.Record{}, err
	}
	size := s.opened.Backend.Size()
	if first {
		// The kernel kept its size; the image may have been resized
		// while nobody served it.
		if err := m.setKernelSize(d.rec, size); err != nil {
			return fail(fmt.Errorf("%s: set the size: %w", d.rec.Device(), err))
		}
	} else {
		if ours, err = m.reattach(&d.rec, size); err != nil {
			return fail(err)
		}
		lap(&handed)
	}
	if err := s.opened.Activate(); err != nil {
		return fail(err)
	}
	lap(&locked)
	if err := s.serve(ours, m.log); err != nil {
		s.stop(5 * time.Second)
		return control.Record{}, err
	}
	if d.rec, err = m.keepPassphrase(d.rec); err != nil {
		s.stop(5 * time.Second)
		return control.Record{}, err
	}
	rec = d.rec
	d.s = s
	d.events.reattached.Add(1)
	m.mu.Lock()
	m.devs[rec.Index] = d
	m.mu.Unlock()
	if err := m.cfg.Store.Save(d.rec); err != nil {
		m.log.Error("attached, but the state was not saved", "device", rec.Device(), "err", err)
	}
	m.tuneQueue(rec)
	// Where a restart's wait goes: handing the kernel its new sockets
	// (first, or after the lock), the image's open, and the fence and
	// lock before anything is read.
	ms := func(d time.Duration) time.Duration { return d.Round(time.Millisecond) }
	m.log.Info("attached", "device", rec.Device(), "spec", rec.Spec, "connections", rec.Connections,
		"took", ms(time.Since(t0)), "sockets_first", first, "reconfigure", ms(handed), "open", ms(opened),
		"lock", ms(locked))
	return d.rec, nil
}

func mergeAttach(cur, req control.Record) control.Record {
	out := cur
	if req.Ceph != (ceph.Options{}) {
		out.Ceph = req.Ceph
	}
	if req.Encryption.Format != "" {
		out.Encryption = req.Encryption
	}
	return out
}

// reattach hands the kernel one new socket per dead connection, however
// many the device has (the caller may not know: ceph-csi's attach does
// not say), and returns our ends, not yet served. One RECONFIGURE per
// socket, because the kernel replaces dead sockets one at a time and
// stops at the first failure; a socket it did not take means no dead
// socket is left — or, for the first one, that the kernel has not yet
// noticed the old server is gone, so that one is retried. The first
// RECONFIGURE sets size, unless it is 0 (the kernel keeps its own). On an
// error every end handed is closed again.
func (m *Manager) reattach(rec *control.Record, size uint64) ([]*os.File, error) {
	deadline := time.Now().Add(m.cfg.ReattachWait)
	var ours []*os.File
	for len(ours) < control.MaxConnections {
		rc := kernel.Reconfig{BackendID: rec.Cookie, DeadConnTimeout: rec.ReattachTimeout}
		if len(ours) == 0 && size != 0 {
			rc.Size, rc.BlockSize = size, rec.BlockSize
		}
		end, err := m.giveSocket(rec.Index, rc)
		switch {
		case err == nil:
			ours = append(ours, end)
			continue
		case !errors.Is(err, syscall.ENOSPC):
			closeAll(ours)
			return nil, err
		case len(ours) > 0:
			rec.Connections = len(ours)
			return ours, nil
		case time.Now().After(deadline):
			return nil, err
		}
		time.Sleep(50 * time.Millisecond)
	}
	rec.Connections = len(ours)
	return ours, nil
}

// errNoDeadConnection: RECONFIGURE found no dead connection to replace.
var errNoDeadConnection = fmt.Errorf("no dead connection to replace: %w", syscall.ENOSPC)

// giveSocket gives a connected device one more connection through
// RECONFIGURE (it replaces a dead one) and returns our end, unserved.
//
// The kernel's answer cannot say whether it took the socket: with no dead
// connection to replace it drops the socket and still reports success
// (nbd_genl_reconfigure turns that ENOSPC into 0). So once our copy of
// the kernel's end is closed, a hung-up peer means the kernel kept none.
func (m *Manager) giveSocket(index int, rc kernel.Reconfig) (*os.File, error) {
	kEnds, ours, err := socketpairs(1)
	if err != nil {
		return nil, err
	}
	err = m.cfg.Kernel.Reconfigure(index, rc, kEnds)
	closeAll(kEnds)
	if err == nil && peerGone(ours[0]) {
		err = errNoDeadConnection
	}
	if err != nil {
		closeAll(ours)
		return nil, err
	}
	return ours[0], nil
}

// ReplaceDead gives a served device a fresh connection after the kernel
// declared one dead (LINK_DEAD: a request timed out, or the socket
// failed), so the device keeps all its connections.
func (m *Manager) ReplaceDead(index int) {
	d := m.get(index)
	if d == nil {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.s == nil {
		return
	}
	settled, drained := d.s.settleDead(settleMax, settleGrace)
	if !drained {
		m.log.Warn("the kernel left replies unread on a dead connection; replacing it anyway",
			"device", d.rec.Device(), "waited", settled.Round(time.Millisecond))
	}
	end, err := m.giveSocket(index, kernel.Reconfig{BackendID: d.rec.Cookie})
	if err == nil {
		err = d.s.serve([]*os.File{end}, m.log)
	}
	if err == nil {
		d.events.replaced.Add(1)
	}
	m.log.Info("replaced a dead connection", "device", d.rec.Device(), "settled", settled.Round(time.Millisecond), "err", err)
}

// Restore takes back every device in the store that the kernel still
// has, after a restart. Devices the kernel lost are forgotten.
//
// The records bypass the control server and are not validated again
// here: each was validated by the control server when its map or attach
// came in, before the manager saved it, and only the daemon writes the
// store (root-only, under /run). Attach fills in the defaults, as for
// any request. A check here would leave a device whose record an older
// version wrote, and today's rules refuse, in the kernel but unserved.
func (m *Manager) Restore() error {
	recs, err := m.cfg.Store.Load()
	if err != nil {
		return err
	}
	var errs []error
	var todo []control.Record
	for _, rec := range recs {
		if rec.Detached {
			m.mu.Lock()
			m.devs[rec.Index] = newDevice(rec)
			m.mu.Unlock()
			continue
		}
		if sp, _ := devspec.Parse(rec.Spec); sp.Kind == "mem" {
			// Its data died with the old process: serving an empty
			// disk in its place would be silent corruption.
			m.log.Warn("disconnecting a memory device lost with the previous process", "device", rec.Device())
			m.cfg.Kernel.Disconnect(rec.Index)
			m.cfg.Store.Remove(rec.Index)
			continue
		}
		st, err := m.cfg.Kernel.Status(rec.Index)
		if err != nil || !st.Connected {
			m.log.Warn("forgetting a device the kernel no longer has", "device", rec.Device(), "spec", rec.Spec)
			m.cfg.Store.Remove(rec.Index)
			m.dropPassphrase(rec)
			continue
		}
		todo = append(todo, rec)
	}
	// In parallel, as Adopt: every device waits for its own open, and
	// after a kill -9 each one's stall is the time until it is served.
	var mu sync.Mutex
	fanOut(len(todo), func(i int) {
		if _, err := m.Attach(todo[i]); err != nil {
			mu.Lock()
			errs = append(errs, fmt.Errorf("reattach %s: %w", todo[i].Device(), err))
			mu.Unlock()
		}
	})
	return errors.Join(errs...)
}
