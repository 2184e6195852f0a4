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
	"sync/atomic"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/backend"
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
	// KernelRelease is the running kernel's (kernel.Release() if empty):
	// a resend interval needs 5.7 or later.
	KernelRelease string
	// open opens a device's backend: backend.Open unless a test gives
	// one whose Activate it controls.
	open func(spec string, o backend.Options) (*backend.Opened, error)
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
	// stats counts the device's requests, and events what happened to
	// it, from its map (or this daemon's start) until its unmap, across
	// socket replacements, detaches and attaches.
	stats  *nbd.Stats
	events *deviceEvents
}

// deviceEvents counts a device's connection changes and resizes.
type deviceEvents struct {
	// replaced: dead sockets replaced after the kernel's LINK_DEAD;
	// reattached: new sockets after a detach, or after a restart.
	replaced, reattached, resized atomic.Uint64
}

// newDevice is a device record with fresh counters.
func newDevice(rec control.Record) *device {
	return &device{rec: rec, stats: nbd.NewStats(), events: &deviceEvents{}}
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
	if cfg.KernelRelease == "" {
		cfg.KernelRelease = kernel.Release()
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

// sysfs is the path of a device's attribute under /sys/block/nbdN.
func (m *Manager) sysfs(index int, attr ...string) string {
	return filepath.Join(append([]string{m.cfg.SysBlock, fmt.Sprintf("nbd%d", index)}, attr...)...)
}

// tuneQueue raises max_sectors_kb so large I/O reaches us unsplit (the
// kernel's default caps it at 1280 KiB; RBD objects are 4 MiB), and sets
// the block layer's request timer to the resend interval. NBD's own
// timeout being 0, that timer never fails or retries a request on a
// live socket; it only resends one whose socket was replaced (see
// control.MapOptions.ResendInterval). Only sysfs sets it apart from
// NBD's timeout, which would set both. Failing, the device keeps the
// kernel's 30 s: slower after a restart, never less safe.
func (m *Manager) tuneQueue(rec control.Record) {
	q := m.sysfs(rec.Index, "queue")
	if rec.ResendInterval > 0 {
		ms := strconv.FormatInt(rec.ResendInterval.Milliseconds(), 10)
		if err := os.WriteFile(filepath.Join(q, "io_timeout"), []byte(ms), 0); err != nil {
			m.log.Warn("cannot set the resend interval; the kernel's 30 s stays", "device", rec.Device(), "err", err)
		}
	}
	if rec.MaxSectorsKB <= 0 {
		return
	}
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
	if err := m.setKernelSize(d.rec, size); err != nil {
		m.log.Error("resize of the kernel device failed", "device", d.rec.Device(), "size", size, "err", err)
		return
	}
	d.events.resized.Add(1)
	m.log.Info("resized", "device", d.rec.Device(), "size", size)
}

// setKernelSize tells the kernel rec's device is size bytes long (a
// RECONFIGURE without sockets).
func (m *Manager) setKernelSize(rec control.Record, size uint64) error {
	return m.cfg.Kernel.Reconfigure(rec.Index, kernel.Reconfig{Size: size, BlockSize: rec.BlockSize, BackendID: rec.Cookie}, nil)
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
