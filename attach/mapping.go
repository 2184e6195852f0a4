package attach

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/control"
	"github.com/rbd-nbd-go/rbd-nbd-go/kernel"
)

// Map and unmap: a new kernel device served from a new backend, and its
// teardown.

// Map makes a new device for rec (rec.Index may be kernel.AnyIndex) and
// returns its record. On any failure nothing is left behind. rec must
// have passed control.Record.Validate: the daemon's control server,
// its only caller, checks every request once, on receipt.
func (m *Manager) Map(rec control.Record) (control.Record, error) {
	rec.Defaults()
	if rec.ResendInterval > 0 && !kernel.ResendsOnNewSocket(m.cfg.KernelRelease) {
		return control.Record{}, fmt.Errorf("resend-interval needs Linux 5.7 or later (this is %s): before it, "+
			"a one-connection device cannot take a new socket nor resend on one", m.cfg.KernelRelease)
	}
	if rec.Index != kernel.AnyIndex {
		if m.get(rec.Index) != nil {
			return control.Record{}, fmt.Errorf("%s is busy (already mapped)", rec.Device())
		}
	}
	d := newDevice(rec)
	s, err := m.newServed(rec, m.backendOptions(d), d.stats)
	if err != nil {
		return control.Record{}, err
	}
	m.watchIdle(d, s)
	var kEnds, ours []*os.File
	fail := func(err error) (control.Record, error) {
		closeAll(kEnds) // our ends' readers see EOF at once
		s.stop(time.Second)
		return control.Record{}, err
	}
	size := s.opened.Backend.Size()
	if size < rec.BlockSize {
		return fail(fmt.Errorf("%s: size %d is smaller than one block", rec.Spec, size))
	}
	if kEnds, ours, err = socketpairs(rec.Connections); err != nil {
		return fail(err)
	}
	// Serve first: the kernel may send I/O (partition scan) as soon as
	// it is connected.
	if err := s.serve(ours, m.log); err != nil {
		return fail(err)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	index, err := m.cfg.Kernel.Connect(kernelConfig(rec, s.flags(rec), size), kEnds)
	if err != nil {
		return fail(err)
	}
	closeAll(kEnds) // the kernel holds its own references now
	d.rec.Index, d.s = index, s
	undo := func(cause error) (control.Record, error) {
		m.cfg.Kernel.Disconnect(index)
		s.stop(5 * time.Second)
		return control.Record{}, cause
	}
	m.mu.Lock()
	if m.devs[index] != nil {
		m.mu.Unlock()
		return undo(fmt.Errorf("%s is already served here", d.rec.Device()))
	}
	m.devs[index] = d
	m.mu.Unlock()
	kept, err := m.keepPassphrase(d.rec)
	if err != nil {
		m.drop(index)
		return undo(err)
	}
	m.mu.Lock()
	d.rec = kept
	m.mu.Unlock()
	if err := m.cfg.Store.Save(d.rec); err != nil {
		m.drop(index)
		m.dropPassphrase(d.rec)
		return undo(err)
	}
	m.tuneQueue(d.rec)
	m.log.Info("mapped", "device", d.rec.Device(), "spec", rec.Spec, "connections", rec.Connections,
		"size", size, "via", m.cfg.Kernel.Name())
	return d.rec, nil
}

// Unmap flushes and disconnects a device and forgets it. A mounted (or
// exclusively opened) device is refused with control.ErrBusy.
func (m *Manager) Unmap(target string) error { return m.UnmapCookie(target, "") }

// UnmapCookie is Unmap of a device only if it still carries cookie
// (empty: any). The check is made under the device's lock, so a caller
// that looked the device up first cannot unmap another volume that took
// its index meanwhile.
func (m *Manager) UnmapCookie(target, cookie string) error {
	start := time.Now()
	d, err := m.lockTarget(target)
	if err != nil {
		return err
	}
	defer d.mu.Unlock()
	rec := d.rec
	if cookie != "" && rec.Cookie != cookie {
		return control.ErrNotMapped
	}
	path := filepath.Join(m.cfg.Dev, fmt.Sprintf("nbd%d", rec.Index))
	t0 := time.Now()
	if f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_EXCL, 0); err == nil {
		// Push the device's page cache down before the sockets go.
		f.Sync()
		f.Close()
	} else if errors.Is(err, syscall.EBUSY) {
		return fmt.Errorf("%s: %w (mounted or held open)", rec.Device(), control.ErrBusy)
	}
	t1 := time.Now()
	derr := m.cfg.Kernel.Disconnect(rec.Index)
	t2 := time.Now()
	serr := d.stopServing()
	t3 := time.Now()
	m.drop(rec.Index)
	err = errors.Join(derr, serr, m.cfg.Store.Remove(rec.Index), m.dropPassphrase(rec))
	// The phases' times say where a slow unmap waited: on the device's
	// lock (took less the rest), on the page cache (the exclusive open
	// and fsync), on the kernel, or on the backend's flush and close.
	m.log.Info("unmapped", "device", rec.Device(), "spec", rec.Spec,
		"took", time.Since(start).Round(time.Millisecond), "sync", t1.Sub(t0).Round(time.Millisecond), "disconnect", t2.Sub(t1).Round(time.Millisecond),
		"stop", t3.Sub(t2).Round(time.Millisecond), "err", err)
	return err
}
