package attach

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rbd-nbd-go/rbd-nbd-go/control"
	"github.com/rbd-nbd-go/rbd-nbd-go/kernel"
	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
)

type rig struct {
	k     *fakeKernel
	store *Store
	dir   string
	sys   string
}

func newRig(t *testing.T) *rig {
	dir := t.TempDir()
	st, err := OpenStore(filepath.Join(dir, "state"))
	if err != nil {
		t.Fatal(err)
	}
	sys := filepath.Join(dir, "sys")
	for i := range 4 {
		q := filepath.Join(sys, "nbd"+string(rune('0'+i)), "queue")
		os.MkdirAll(q, 0o755)
		os.WriteFile(filepath.Join(q, "max_hw_sectors_kb"), []byte("32768\n"), 0o644)
	}
	return &rig{k: newFakeKernel(), store: st, dir: dir, sys: sys}
}

func (r *rig) manager(t *testing.T) *Manager {
	m := NewManager(Config{Kernel: r.k, Store: r.store, SysBlock: r.sys, Dev: filepath.Join(r.dir, "dev"),
		ReattachWait: 2 * time.Second})
	t.Cleanup(func() { m.Close() })
	return m
}

func (r *rig) file(t *testing.T, size int64) string { return r.fileNamed(t, "disk.img", size) }

// fileNamed makes a backing file of size under the rig's directory.
func (r *rig) fileNamed(t *testing.T, name string, size int64) string {
	p := filepath.Join(r.dir, name)
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	f.Truncate(size)
	f.Close()
	return "file:" + p
}

func TestMapServesEveryConnection(t *testing.T) {
	r := newRig(t)
	m := r.manager(t)
	rec, err := m.Map(control.Record{Index: kernel.AnyIndex, Spec: "mem:8M", Cookie: "c1",
		MapOptions: control.MapOptions{Connections: 3, ReattachTimeout: 300 * time.Second, MaxSectorsKB: 4096}})
	if err != nil {
		t.Fatal(err)
	}
	d := r.k.dev(t, rec.Index)
	want := nbd.FlagHasFlags | nbd.FlagSendFlush | nbd.FlagSendFUA | nbd.FlagSendTrim |
		nbd.FlagSendWriteZeroes | nbd.FlagCanMultiConn
	if len(d.socks) != 3 || d.cfg.Size != 8<<20 || d.cfg.BackendID != "c1" || d.cfg.BlockSize != 4096 ||
		d.cfg.DeadConnTimeout != 300*time.Second || nbd.TransmissionFlags(d.cfg.ServerFlags)&want != want ||
		d.cfg.ServerFlags&uint64(nbd.FlagReadOnly) != 0 {
		t.Fatalf("kernel config %+v flags %#x, %d sockets", d.cfg, d.cfg.ServerFlags, len(d.socks))
	}
	// A write on one connection is read back on another (one backend).
	data := bytes.Repeat([]byte{0xab}, 4096)
	if e, _ := kio(t, d.socks[0], cmdWrite, 8192, 4096, data); e != 0 {
		t.Fatalf("write errno %d", e)
	}
	if e, _ := kio(t, d.socks[2], cmdFlush, 0, 0, nil); e != 0 {
		t.Fatalf("flush errno %d", e)
	}
	if e, got := kio(t, d.socks[1], cmdRead, 8192, 4096, nil); e != 0 || !bytes.Equal(got, data) {
		t.Fatalf("read errno %d", e)
	}
	// Out of range gets an error reply, not a crash.
	if e, _ := kio(t, d.socks[1], cmdRead, 8<<20, 4096, nil); e == 0 {
		t.Fatal("read past the end succeeded")
	}
	b, _ := os.ReadFile(filepath.Join(r.sys, "nbd0", "queue", "max_sectors_kb"))
	if string(b) != "4096" {
		t.Fatalf("max_sectors_kb %q", b)
	}
	recs, _ := r.store.Load()
	if len(recs) != 1 || recs[0].Spec != "mem:8M" || recs[0].Cookie != "c1" {
		t.Fatalf("state %+v", recs)
	}
	if fi, _ := os.Stat(filepath.Dir(r.store.path(0))); fi.Mode().Perm() != 0o700 {
		t.Fatalf("state dir mode %v", fi.Mode())
	}
}

func TestMapFlagsFollowOptions(t *testing.T) {
	r := newRig(t)
	m := r.manager(t)
	rec, err := m.Map(control.Record{Index: 2, Spec: "mem:1M", MapOptions: control.MapOptions{ReadOnly: true, NoTrim: true}})
	if err != nil {
		t.Fatal(err)
	}
	if rec.Index != 2 || rec.Device() != "/dev/nbd2" {
		t.Fatalf("index %d", rec.Index)
	}
	f := nbd.TransmissionFlags(r.k.dev(t, 2).cfg.ServerFlags)
	if f&nbd.FlagReadOnly == 0 || f&nbd.FlagSendTrim != 0 || f&nbd.FlagCanMultiConn != 0 {
		t.Fatalf("flags %#x", f)
	}
	if _, err := m.Map(control.Record{Index: 2, Spec: "mem:1M"}); err == nil || !strings.Contains(err.Error(), "busy") {
		t.Fatalf("second map of nbd2: %v", err)
	}
}

// TestMapResendInterval: the resend interval becomes the queue's
// request timer, and a kernel older than 5.7 is refused before anything
// is made.
func TestMapResendInterval(t *testing.T) {
	r := newRig(t)
	m := NewManager(Config{Kernel: r.k, Store: r.store, SysBlock: r.sys, Dev: filepath.Join(r.dir, "dev"),
		KernelRelease: "6.1.0-28-amd64"})
	t.Cleanup(func() { m.Close() })
	opts := control.MapOptions{Connections: 1, ResendInterval: 3 * time.Second}
	rec, err := m.Map(control.Record{Index: 1, Spec: "mem:1M", MapOptions: opts})
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(r.sys, "nbd1", "queue", "io_timeout")); string(b) != "3000" {
		t.Fatalf("io_timeout %q", b)
	}
	if d := r.k.dev(t, rec.Index); d.cfg.Timeout != 0 {
		t.Fatalf("NBD timeout %v, want 0", d.cfg.Timeout)
	}
	// Without a resend interval the queue's timer is left alone.
	if _, err := m.Map(control.Record{Index: 2, Spec: "mem:1M", MapOptions: control.MapOptions{Connections: 1}}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(r.sys, "nbd2", "queue", "io_timeout")); !os.IsNotExist(err) {
		t.Fatalf("io_timeout written without a resend interval: %v", err)
	}

	old := NewManager(Config{Kernel: r.k, Store: r.store, SysBlock: r.sys, Dev: filepath.Join(r.dir, "dev"),
		KernelRelease: "5.4.0-216-generic"})
	t.Cleanup(func() { old.Close() })
	_, err = old.Map(control.Record{Index: 3, Spec: "mem:1M", MapOptions: opts})
	if err == nil || !strings.Contains(err.Error(), "needs Linux 5.7 or later (this is 5.4.0-216-generic)") {
		t.Fatalf("map on 5.4: %v", err)
	}
	if _, ok := r.k.devs[3]; ok {
		t.Fatal("the refused map reached the kernel")
	}
}

func TestMapFailureLeavesNothing(t *testing.T) {
	r := newRig(t)
	m := r.manager(t)
	if _, err := m.Map(control.Record{Index: kernel.AnyIndex, Spec: "file:" + filepath.Join(r.dir, "missing")}); err == nil {
		t.Fatal("missing file mapped")
	}
	r.k.connectErr = errInjected
	if _, err := m.Map(control.Record{Index: kernel.AnyIndex, Spec: "mem:1M"}); !errors.Is(err, errInjected) {
		t.Fatalf("connect failure: %v", err)
	}
	if recs, _ := r.store.Load(); len(recs) != 0 || len(m.List()) != 0 || len(r.k.devs) != 0 {
		t.Fatalf("left behind: state %v, list %v, kernel %v", recs, m.List(), r.k.devs)
	}
}

func TestRestartReattachesWithCookie(t *testing.T) {
	r := newRig(t)
	spec := r.file(t, 4<<20)
	m1 := NewManager(Config{Kernel: r.k, Store: r.store, SysBlock: r.sys, Dev: r.dir})
	rec, err := m1.Map(control.Record{Index: kernel.AnyIndex, Spec: spec, Cookie: "vol-7", MapOptions: control.MapOptions{Connections: 2}})
	if err != nil {
		t.Fatal(err)
	}
	data := bytes.Repeat([]byte("reattach"), 512)
	d := r.k.dev(t, rec.Index)
	if e, _ := kio(t, d.socks[0], cmdWrite, 0, 4096, data); e != 0 {
		t.Fatal(e)
	}
	// The process goes away; the kernel keeps the device.
	if err := m1.Close(); err != nil {
		t.Fatal(err)
	}
	m2 := r.manager(t)
	if err := m2.Restore(); err != nil {
		t.Fatal(err)
	}
	for i, s := range d.socks {
		if e, got := kio(t, s, cmdRead, 0, 4096, nil); e != 0 || !bytes.Equal(got, data) {
			t.Fatalf("socket %d after reattach: errno %d", i, e)
		}
	}
	if len(m2.List()) != 1 || r.k.reconfigs[0].BackendID != "vol-7" {
		t.Fatalf("list %v reconfigs %+v", m2.List(), r.k.reconfigs)
	}
	// The kernel reports success for the third socket too, but drops it:
	// the reattach must count only the sockets it kept. A fourth
	// RECONFIGURE gives the kernel the size once the image is open (the
	// sockets went first: no io-timeout).
	if got := m2.List()[0].Connections; got != 2 || len(r.k.reconfigs) != 4 {
		t.Fatalf("reattached %d connections in %d RECONFIGUREs, want 2 in 3 and the size", got, len(r.k.reconfigs))
	}
	// attach of the same device and cookie is a no-op; another cookie is refused.
	if _, err := m2.Attach(control.Record{Index: rec.Index, Spec: spec, Cookie: "vol-7"}); err != nil {
		t.Fatalf("repeated attach: %v", err)
	}
	if _, err := m2.Attach(control.Record{Index: rec.Index, Spec: spec, Cookie: "other"}); err == nil {
		t.Fatal("attach with a foreign cookie succeeded")
	}
}

func TestDetachAttachUnmap(t *testing.T) {
	r := newRig(t)
	spec := r.file(t, 1<<20)
	m := r.manager(t)
	rec, err := m.Map(control.Record{Index: kernel.AnyIndex, Spec: spec, Cookie: "k"})
	if err != nil {
		t.Fatal(err)
	}
	if e, _ := kio(t, r.k.dev(t, rec.Index).socks[0], cmdFlush, 0, 0, nil); e != 0 {
		t.Fatalf("flush before detach: %d", e)
	}
	if err := m.Detach(rec.Device()); err != nil {
		t.Fatal(err)
	}
	if recs, _ := r.store.Load(); len(recs) != 1 || !recs[0].Detached {
		t.Fatalf("detached state %+v", recs)
	}
	if _, err := m.Attach(control.Record{Index: rec.Index, Spec: spec, Cookie: "k"}); err != nil {
		t.Fatal(err)
	}
	if e, _ := kio(t, r.k.dev(t, rec.Index).socks[0], cmdFlush, 0, 0, nil); e != 0 {
		t.Fatalf("flush after attach: %d", e)
	}
	// The counters carry on across the detach: the flush before it is
	// still counted, and the attach is one reattach.
	st := stats(t, m, rec.Index)
	if st.Reattached != 1 || st.Stats.Ops["flush"].Requests != 2 {
		t.Fatalf("after detach and attach: %d reattaches, %d flushes", st.Reattached, st.Stats.Ops["flush"].Requests)
	}
	if err := m.Unmap(spec); err != nil {
		t.Fatal(err)
	}
	if err := m.Unmap(rec.Device()); !errors.Is(err, control.ErrNotMapped) {
		t.Fatalf("second unmap: %v", err)
	}
	if recs, _ := r.store.Load(); len(recs) != 0 || len(m.List()) != 0 {
		t.Fatalf("after unmap: %v %v", recs, m.List())
	}
}

func TestResizeReconfigures(t *testing.T) {
	r := newRig(t)
	m := r.manager(t)
	rec, _ := m.Map(control.Record{Index: kernel.AnyIndex, Spec: "mem:1M", Cookie: "z"})
	m.resized(m.get(rec.Index), 2<<20)
	if r.k.dev(t, rec.Index).cfg.Size != 2<<20 {
		t.Fatal("kernel size not changed")
	}
	if n := stats(t, m, rec.Index).Resized; n != 1 {
		t.Fatalf("%d resizes counted", n)
	}
}

// stats is one device's counters.
func stats(t *testing.T, m *Manager, index int) control.DeviceStats {
	t.Helper()
	for _, s := range m.Stats() {
		if s.Record.Index == index {
			if s.Record.Ceph.Key != "" {
				t.Fatal("stats carry a key")
			}
			return s
		}
	}
	t.Fatalf("no stats of device %d", index)
	return control.DeviceStats{}
}

func TestRestoreDropsMemoryDevices(t *testing.T) {
	r := newRig(t)
	m1 := NewManager(Config{Kernel: r.k, Store: r.store, SysBlock: r.sys, Dev: r.dir})
	rec, err := m1.Map(control.Record{Index: kernel.AnyIndex, Spec: "mem:1M"})
	if err != nil {
		t.Fatal(err)
	}
	m1.Close()
	m2 := r.manager(t)
	if err := m2.Restore(); err != nil {
		t.Fatal(err)
	}
	if st, _ := r.k.Status(rec.Index); st.Connected || len(m2.List()) != 0 {
		t.Fatalf("a lost memory disk was reattached: %+v %v", st, m2.List())
	}
}

// mapMemTwo maps a memory device served on two connections.
func mapMemTwo(t *testing.T, m *Manager) control.Record {
	t.Helper()
	rec, err := m.Map(control.Record{Index: kernel.AnyIndex, Spec: "mem:1M", Cookie: "q", MapOptions: control.MapOptions{Connections: 2}})
	if err != nil {
		t.Fatal(err)
	}
	return rec
}

func TestReplaceDeadConnection(t *testing.T) {
	r := newRig(t)
	m := r.manager(t)
	rec := mapMemTwo(t, m)
	d := r.k.dev(t, rec.Index)
	// The kernel gives up on socket 1 (a request timed out): it shuts
	// its end down and multicasts LINK_DEAD.
	old := d.socks[1]
	unix.Shutdown(int(old.Fd()), unix.SHUT_RDWR)
	m.ReplaceDead(rec.Index)
	if d.socks[1] == old {
		t.Fatal("dead socket not replaced")
	}
	if e, _ := kio(t, d.socks[1], cmdFlush, 0, 0, nil); e != 0 {
		t.Fatalf("flush on the new connection: %d", e)
	}
	if e, _ := kio(t, d.socks[0], cmdFlush, 0, 0, nil); e != 0 {
		t.Fatalf("flush on the surviving connection: %d", e)
	}
	st := stats(t, m, rec.Index)
	for i := 0; i < 100 && st.Stats.Closed == 0; i++ { // the dead one's server ends on its own
		time.Sleep(10 * time.Millisecond)
		st = stats(t, m, rec.Index)
	}
	if st.Replaced != 1 || st.Stats.Conns != 2 || st.Stats.Closed != 1 {
		t.Fatalf("replaced %d, connections %d live, %d closed", st.Replaced, st.Stats.Conns, st.Stats.Closed)
	}
}
