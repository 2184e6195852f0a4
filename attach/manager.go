package attach

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/backend"
	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
	"github.com/rbd-nbd-go/rbd-nbd-go/control"
	"github.com/rbd-nbd-go/rbd-nbd-go/devspec"
	"github.com/rbd-nbd-go/rbd-nbd-go/internal/keyring"
	"github.com/rbd-nbd-go/rbd-nbd-go/kernel"
	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
	"github.com/rbd-nbd-go/rbd-nbd-go/rbdio"
)

// Config wires a Manager to the system.
type Config struct {
	Kernel   kernel.Controller
	Clusters *rbdio.Clusters
	Store    *Store
	Log      *slog.Logger
	// SysBlock and Dev default to /sys/block and /dev; tests move them.
	SysBlock, Dev string
	// Quiesce runs a device's quiesce hook; nil uses RunQuiesceHook.
	Quiesce func(rec control.Record, quiesce bool) (target string, err error)
	// ReattachWait bounds how long a reattach waits for the kernel to
	// notice the old connections are dead.
	ReattachWait time.Duration
	// MemoryBudget bounds the payload bytes in flight over every device
	// (nbd.DefaultMemoryBudget if 0): all devices share one nbd.Shared.
	MemoryBudget int
	// Keys keeps encrypted devices' passphrases; nil means the kernel's
	// user keyring.
	Keys Keys
}

// Manager serves every NBD device of the node.
type Manager struct {
	cfg    Config
	log    *slog.Logger
	shared *nbd.Shared

	mu   sync.Mutex
	devs map[int]*device
}

// Lock order: device.mu before Manager.mu, never the other way.
type device struct {
	mu sync.Mutex // serialises map/unmap/attach/detach/resize of this device
	// rec changes only with both mu and Manager.mu held once the device
	// is in Manager.devs, so either lock is enough to read it.
	rec control.Record
	s   *served // nil while detached
}

// stopServing finishes the requests in flight, flushes and closes the
// backend; the kernel side stays (d.mu held).
func (d *device) stopServing() error {
	if d.s == nil {
		return nil
	}
	err := d.s.stop(30 * time.Second)
	d.s = nil
	return err
}

// NewManager returns a Manager with no devices; Restore takes back those
// in the store.
func NewManager(cfg Config) *Manager {
	if cfg.SysBlock == "" {
		cfg.SysBlock = "/sys/block"
	}
	if cfg.Dev == "" {
		cfg.Dev = "/dev"
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.Quiesce == nil {
		cfg.Quiesce = RunQuiesceHook
	}
	if cfg.ReattachWait <= 0 {
		cfg.ReattachWait = 10 * time.Second
	}
	if cfg.Keys == nil {
		cfg.Keys = keyring.Kernel{Prefix: "rbd-nbd-go:"}
	}
	return &Manager{cfg: cfg, log: cfg.Log, shared: nbd.NewShared(cfg.MemoryBudget), devs: map[int]*device{}}
}

func (m *Manager) backendOptions(d *device) backend.Options {
	rec := d.rec
	o := backend.Options{ReadOnly: rec.ReadOnly, Exclusive: rec.Exclusive, Ceph: rec.Ceph,
		Clusters: m.cfg.Clusters, Encryption: rec.Encryption,
		OnResize: func(size uint64) { m.resized(d, size) }}
	if rec.Quiesce {
		o.OnQuiesce = func(q bool) error {
			rec := d.recCopy()
			target, err := m.cfg.Quiesce(rec, q)
			m.log.Info("snapshot quiesce hook", "device", rec.Device(), "quiesce", q, "target", target, "err", err)
			return err
		}
	}
	return o
}

func (d *device) recCopy() control.Record {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.rec
}

func kernelConfig(r control.Record, flags, size uint64) kernel.Config {
	return kernel.Config{Index: r.Index, Size: size, BlockSize: r.BlockSize, ServerFlags: flags,
		Timeout: r.IOTimeout, DeadConnTimeout: r.ReattachTimeout, BackendID: r.Cookie}
}

// Map makes a new device for rec (rec.Index may be kernel.AnyIndex) and
// returns its record. On any failure nothing is left behind. rec must
// have passed control.Record.Validate: the daemon's control server,
// its only caller, checks every request once, on receipt.
func (m *Manager) Map(rec control.Record) (control.Record, error) {
	rec.Defaults()
	if rec.Index != kernel.AnyIndex {
		if m.get(rec.Index) != nil {
			return control.Record{}, fmt.Errorf("%s is busy (already mapped)", rec.Device())
		}
	}
	d := &device{rec: rec}
	s, err := newServed(rec, m.backendOptions(d), m.shared, m.log)
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

// sysfs is the path of a device's attribute under /sys/block/nbdN.
func (m *Manager) sysfs(index int, attr ...string) string {
	return filepath.Join(append([]string{m.cfg.SysBlock, fmt.Sprintf("nbd%d", index)}, attr...)...)
}

// tuneQueue raises max_sectors_kb so large I/O reaches us unsplit (the
// kernel's default caps it at 1280 KiB; RBD objects are 4 MiB).
func (m *Manager) tuneQueue(rec control.Record) {
	if rec.MaxSectorsKB <= 0 {
		return
	}
	q := m.sysfs(rec.Index, "queue")
	want := rec.MaxSectorsKB
	if b, err := os.ReadFile(filepath.Join(q, "max_hw_sectors_kb")); err == nil {
		if hw, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && hw < want {
			want = hw
		}
	}
	if err := os.WriteFile(filepath.Join(q, "max_sectors_kb"), []byte(strconv.Itoa(want)), 0); err != nil {
		m.log.Warn("cannot set max_sectors_kb", "device", rec.Device(), "err", err)
	}
}

func (m *Manager) get(index int) *device {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.devs[index]
}

func (m *Manager) drop(index int) {
	m.mu.Lock()
	delete(m.devs, index)
	m.mu.Unlock()
}

// resized follows the image: the kernel device takes the new size with no
// remap.
func (m *Manager) resized(d *device, size uint64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.s == nil {
		return
	}
	err := m.cfg.Kernel.Reconfigure(d.rec.Index, kernel.Reconfig{Size: size, BlockSize: d.rec.BlockSize,
		BackendID: d.rec.Cookie}, nil)
	if err != nil {
		m.log.Error("resize of the kernel device failed", "device", d.rec.Device(), "size", size, "err", err)
		return
	}
	m.log.Info("resized", "device", d.rec.Device(), "size", size)
}

// lockTarget resolves a device path (/dev/nbdN) or a spec to a mapped
// device and returns it locked. A device unmapped between the lookup and
// the lock is looked up again.
func (m *Manager) lockTarget(target string) (*device, error) {
	for {
		var found *device
		m.mu.Lock()
		for _, d := range m.devs {
			if d.rec.Device() == target || sameSpec(d.rec.Spec, target) {
				found = d
				break
			}
		}
		m.mu.Unlock()
		if found == nil {
			return nil, control.ErrNotMapped
		}
		found.mu.Lock()
		if m.get(found.rec.Index) == found {
			return found, nil
		}
		found.mu.Unlock()
	}
}

// sameSpec compares specs as Ceph would: "img" is "rbd/img".
func sameSpec(a, b string) bool {
	pa, erra := devspec.Parse(a)
	pb, errb := devspec.Parse(b)
	if erra != nil || errb != nil {
		return a == b
	}
	return pa.String() == pb.String()
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
	rec.Defaults()
	if rec.Index < 0 {
		return control.Record{}, errors.New("attach needs --device")
	}
	if d := m.get(rec.Index); d != nil {
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
	d := &device{rec: rec}
	s, err := newServed(rec, m.backendOptions(d), m.shared, m.log)
	if err != nil {
		return control.Record{}, err
	}
	m.watchIdle(d, s)
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := m.reattach(&d.rec, s); err != nil {
		s.stop(5 * time.Second)
		return control.Record{}, err
	}
	if d.rec, err = m.keepPassphrase(d.rec); err != nil {
		s.stop(5 * time.Second)
		return control.Record{}, err
	}
	rec = d.rec
	d.s = s
	m.mu.Lock()
	m.devs[rec.Index] = d
	m.mu.Unlock()
	if err := m.cfg.Store.Save(d.rec); err != nil {
		m.log.Error("attached, but the state was not saved", "device", rec.Device(), "err", err)
	}
	m.tuneQueue(rec)
	m.log.Info("attached", "device", rec.Device(), "spec", rec.Spec, "connections", rec.Connections)
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
// not say). One RECONFIGURE per socket, because the kernel replaces dead
// sockets one at a time and stops at the first failure; a socket it did
// not take means no dead socket is left — or, for the first one, that
// the kernel has not yet noticed the old server is gone, so that one is
// retried.
func (m *Manager) reattach(rec *control.Record, s *served) error {
	deadline := time.Now().Add(m.cfg.ReattachWait)
	attached := 0
	for attached < control.MaxConnections {
		rc := kernel.Reconfig{BackendID: rec.Cookie, DeadConnTimeout: rec.ReattachTimeout}
		if attached == 0 {
			rc.Size, rc.BlockSize = s.opened.Backend.Size(), rec.BlockSize
		}
		err := m.addSocket(rec.Index, rc, s)
		switch {
		case err == nil:
			attached++
			continue
		case !errors.Is(err, syscall.ENOSPC):
			return err
		case attached > 0:
			rec.Connections = attached
			return nil
		case time.Now().After(deadline):
			return err
		}
		time.Sleep(50 * time.Millisecond)
	}
	rec.Connections = attached
	return nil
}

// errNoDeadConnection: RECONFIGURE found no dead connection to replace.
var errNoDeadConnection = fmt.Errorf("no dead connection to replace: %w", syscall.ENOSPC)

// addSocket gives a connected device one more connection through
// RECONFIGURE (it replaces a dead one) and serves our end.
//
// The kernel's answer cannot say whether it took the socket: with no dead
// connection to replace it drops the socket and still reports success
// (nbd_genl_reconfigure turns that ENOSPC into 0). So once our copy of
// the kernel's end is closed, a hung-up peer means the kernel kept none.
func (m *Manager) addSocket(index int, rc kernel.Reconfig, s *served) error {
	kEnds, ours, err := socketpairs(1)
	if err != nil {
		return err
	}
	err = m.cfg.Kernel.Reconfigure(index, rc, kEnds)
	closeAll(kEnds)
	if err == nil && peerGone(ours[0]) {
		err = errNoDeadConnection
	}
	if err != nil {
		closeAll(ours)
		return err
	}
	return s.serve(ours, m.log)
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
	err := m.addSocket(index, kernel.Reconfig{BackendID: d.rec.Cookie}, d.s)
	m.log.Info("replaced a dead connection", "device", d.rec.Device(), "err", err)
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
	for _, rec := range recs {
		if rec.Detached {
			m.mu.Lock()
			m.devs[rec.Index] = &device{rec: rec}
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
		if _, err := m.Attach(rec); err != nil {
			errs = append(errs, fmt.Errorf("reattach %s: %w", rec.Device(), err))
		}
	}
	return errors.Join(errs...)
}

// Status reports how the device at target (path or spec) is doing; with
// usage, also the bytes its image allocated (computed under the device's
// lock, which keeps the image open meanwhile; cheap with fast-diff, and
// never attempted without it).
func (m *Manager) Status(target string, usage bool) (control.Status, error) {
	d, err := m.lockTarget(target)
	if err != nil {
		return control.Status{}, err
	}
	defer d.mu.Unlock()
	st := control.Status{Record: d.rec, Connections: d.rec.Connections}
	if d.s == nil {
		return st, nil
	}
	st.Served = true
	st.Live = int(d.s.live.Load())
	st.Size = d.s.opened.Backend.Size()
	if !usage {
		return st, nil
	}
	if u, ok := d.s.opened.Backend.(interface{ Used() (uint64, error) }); ok {
		if n, err := u.Used(); err != nil {
			st.UsedError = err.Error()
		} else {
			st.Used = &n
		}
	} else {
		st.UsedError = "the backend cannot tell its allocation"
	}
	return st, nil
}

// List returns every device, ordered by index.
func (m *Manager) List() []control.Record {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]control.Record, 0, len(m.devs))
	for _, d := range m.devs {
		out = append(out, d.rec)
	}
	sortRecords(out)
	return out
}

// Close stops serving every device but leaves them in the kernel, as a
// crash would: the next process reattaches them.
func (m *Manager) Close() error {
	m.mu.Lock()
	devs := m.devs
	m.devs = map[int]*device{}
	m.mu.Unlock()
	var errs []error
	for _, d := range devs {
		d.mu.Lock()
		errs = append(errs, d.stopServing())
		d.mu.Unlock()
	}
	return errors.Join(errs...)
}
