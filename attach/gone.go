package attach

import (
	"errors"
	"os"
	"strings"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/control"
)

// A device can leave the kernel without us: another tool's disconnect
// (Ceph's `rbd-nbd unmap`, `nbd-client -d`), or the index taken over by
// someone else after the kernel gave up on us. The kernel then closes its
// sockets and all of a device's connections end. Ceph's rbd-nbd simply
// exits then; the shared daemon has to let go of what the device held —
// the open image (its watch, its exclusive lock) and the state record —
// or list-mapped keeps showing a dead device and the next restart tries
// to reattach it.
//
// Connections also all end while the kernel keeps the device: every one
// timed out (the kernel then waits for RECONFIGURE, and LINK_DEAD brings
// new sockets), or a reattach is on its way. So the end of the last
// connection only starts a watch, which asks the kernel, with backoff,
// until a connection is back or the kernel says the device is gone.
const (
	goneFirstCheck = 200 * time.Millisecond
	goneMaxCheck   = 5 * time.Second
)

// watchIdle makes s, once its last connection ends, watch whether d is
// still in the kernel.
func (m *Manager) watchIdle(d *device, s *served) {
	s.idle = func() {
		go func() {
			for wait := goneFirstCheck; !m.releaseIfGone(d, s); wait = min(2*wait, goneMaxCheck) {
				time.Sleep(wait)
			}
		}()
	}
}

// releaseIfGone releases d if the kernel no longer has it. It returns
// true when there is nothing more to watch: d released, or s no longer
// idle or no longer d's (unmapped, detached, closed or reattached by us).
func (m *Manager) releaseIfGone(d *device, s *served) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.s != s || s.live.Load() > 0 || m.get(d.rec.Index) != d {
		return true
	}
	rec := d.rec
	if !m.kernelLost(rec) {
		return false
	}
	err := d.stopServing()
	m.drop(rec.Index)
	err = errors.Join(err, m.cfg.Store.Remove(rec.Index))
	m.log.Warn("the kernel disconnected the device without us: released it", "device", rec.Device(),
		"spec", rec.Spec, "err", err)
	return true
}

// kernelLost reports whether the kernel no longer has rec's device: not
// connected, gone, or connected under another backend identifier (the
// index was mapped anew by someone else). A failed query is no answer.
func (m *Manager) kernelLost(rec control.Record) bool {
	st, err := m.cfg.Kernel.Status(rec.Index)
	if err != nil {
		return errors.Is(err, os.ErrNotExist)
	}
	if !st.Connected {
		return true
	}
	b, err := os.ReadFile(m.sysfs(rec.Index, "backend"))
	id := strings.TrimSpace(string(b))
	return err == nil && id != "" && rec.Cookie != "" && id != rec.Cookie
}
