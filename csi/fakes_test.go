package csi

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"k8s.io/mount-utils"
	utilexec "k8s.io/utils/exec"
	testingexec "k8s.io/utils/exec/testing"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
	"github.com/rbd-nbd-go/rbd-nbd-go/control"
)

// fakeImages is image management in memory, keyed by spec string.
type fakeImages struct {
	mu      sync.Mutex
	images  map[string]ceph.ImageInfo
	pools   map[string]bool
	goodKey string
	ss      *fakeSnapState // fakesnap_test.go
}

func newFakeImages() *fakeImages {
	return &fakeImages{images: map[string]ceph.ImageInfo{}, pools: map[string]bool{"rbd": true, "other": true},
		goodKey: "AQDkey"}
}

func (f *fakeImages) check(o ceph.Options, pool string) error {
	if o.Key != f.goodKey {
		return fmt.Errorf("connect: %w", ceph.ErrPermission)
	}
	if o.MonHost == "" {
		return fmt.Errorf("no monitors")
	}
	if !f.pools[pool] {
		return fmt.Errorf("pool %q: %w", pool, ceph.ErrPoolNotFound)
	}
	return nil
}

func (f *fakeImages) CreateImage(o ceph.Options, spec ceph.ImageSpec, n ceph.NewImage) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.check(o, spec.Pool); err != nil {
		return err
	}
	if _, ok := f.images[spec.String()]; ok {
		return fmt.Errorf("exists")
	}
	meta := map[string]string{}
	for k, v := range n.Meta {
		meta[k] = v
	}
	f.images[spec.String()] = ceph.ImageInfo{Spec: spec, ID: f.newID(), Size: n.Size, Features: n.Features, Meta: meta}
	return nil
}

func (f *fakeImages) ImageInfo(o ceph.Options, spec ceph.ImageSpec) (ceph.ImageInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.check(o, spec.Pool); err != nil {
		return ceph.ImageInfo{}, err
	}
	i, ok := f.images[spec.String()]
	if !ok {
		return i, fmt.Errorf("image %s: %w", spec, ceph.ErrImageNotFound)
	}
	return i, nil
}

func (f *fakeImages) ResizeImage(o ceph.Options, spec ceph.ImageSpec, size uint64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.check(o, spec.Pool); err != nil {
		return err
	}
	i, ok := f.images[spec.String()]
	if !ok {
		return ceph.ErrImageNotFound
	}
	i.Size = size
	f.images[spec.String()] = i
	return nil
}

func (f *fakeImages) RemoveImage(o ceph.Options, spec ceph.ImageSpec) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.check(o, spec.Pool); err != nil {
		return err
	}
	i, ok := f.images[spec.String()]
	if !ok {
		return ceph.ErrImageNotFound
	}
	if i.Watchers > 0 {
		return ceph.ErrImageInUse
	}
	if len(f.snapState().snaps[i.ID]) > 0 {
		return ceph.ErrHasSnapshots
	}
	delete(f.images, spec.String())
	if p := i.Parent; p != nil {
		f.dropTrashed(p.Ref(), p.SnapID)
	}
	return nil
}

func (f *fakeImages) ListImages(o ceph.Options, spec ceph.ImageSpec, key string) ([]ceph.ImageInfo, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.check(o, spec.Pool); err != nil {
		return nil, err
	}
	var out []ceph.ImageInfo
	for _, i := range f.images {
		if i.Spec.Pool == spec.Pool && i.Spec.Namespace == spec.Namespace && i.Meta[key] != "" {
			out = append(out, i)
		}
	}
	return out, nil
}

func (f *fakeImages) ListPools(o ceph.Options) ([]string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.check(o, "rbd"); err != nil {
		return nil, err
	}
	var out []string
	for p := range f.pools {
		out = append(out, p)
	}
	return out, nil
}

func (f *fakeImages) PoolAvailable(o ceph.Options, pool string) (uint64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return 5 << 30, f.check(o, pool)
}

func (f *fakeImages) setWatchers(spec string, n int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	i := f.images[spec]
	i.Watchers = n
	f.images[spec] = i
}

// fakeDaemon is the node daemon: devices by index, each a file under
// dev standing in for /dev/nbdN.
type fakeDaemon struct {
	mu      sync.Mutex
	devs    map[int]control.Record
	mapErr  error
	lateErr error // returned after mapping: a map that outlived its caller
	busy    bool
	blockOn chan struct{} // Map waits on it, if set,
	inMap   chan struct{} // after closing this, if set
	maps    []control.Record
}

func (a *fakeDaemon) Map(ctx context.Context, rec control.Record) (control.Record, error) {
	if a.blockOn != nil {
		if a.inMap != nil {
			close(a.inMap)
		}
		<-a.blockOn
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := rec.Validate(); err != nil {
		return control.Record{}, err
	}
	if a.mapErr != nil {
		return control.Record{}, a.mapErr
	}
	// The kernel picks the first free device.
	rec.Index = 0
	for a.devs[rec.Index].Spec != "" {
		rec.Index++
	}
	a.devs[rec.Index] = rec
	a.maps = append(a.maps, rec)
	if a.lateErr != nil {
		return control.Record{}, a.lateErr
	}
	return rec.Public(), nil
}

func (a *fakeDaemon) UnmapCookie(ctx context.Context, target, cookie string) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	for i, r := range a.devs {
		if r.Device() == target && r.Cookie == cookie {
			if a.busy {
				return fmt.Errorf("%s: %w", target, control.ErrBusy)
			}
			delete(a.devs, i)
			return nil
		}
	}
	return control.ErrNotMapped
}

func (a *fakeDaemon) List(ctx context.Context) (control.Listing, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	var l control.Listing
	for _, r := range a.devs {
		l.Devices = append(l.Devices, r.Public())
	}
	return l, nil
}

func (a *fakeDaemon) Status(ctx context.Context, target string, usage bool) (control.Status, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, r := range a.devs {
		if r.Device() == target {
			used := uint64(3 << 20)
			return control.Status{Record: r, Served: true, Connections: r.Connections, Live: r.Connections,
				Used: &used}, nil
		}
	}
	return control.Status{}, control.ErrNotMapped
}

func (a *fakeDaemon) Ping(ctx context.Context) error { return nil }

func (a *fakeDaemon) mapped() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.devs)
}

// fakeMounter is mount-utils' fake with injectable mount failures.
type fakeMounter struct {
	*mount.FakeMounter
	mountErr error
}

func (m *fakeMounter) MountSensitive(source, target, fstype string, options, sensitive []string) error {
	if m.mountErr != nil {
		return m.mountErr
	}
	return m.FakeMounter.MountSensitive(source, target, fstype, options, sensitive)
}

func (m *fakeMounter) Mount(source, target, fstype string, options []string) error {
	return m.MountSensitive(source, target, fstype, options, nil)
}

// scriptExec runs blkid, mkfs.*, fsck, resize2fs and xfs_growfs as
// scripted: blkid reports the device's recorded filesystem (none: exit 2).
type scriptExec struct {
	mu       sync.Mutex
	formats  map[string]string // device → filesystem
	mkfsErr  error
	commands [][]string
}

func (e *scriptExec) Command(cmd string, args ...string) utilexec.Cmd {
	e.mu.Lock()
	e.commands = append(e.commands, append([]string{cmd}, args...))
	e.mu.Unlock()
	run := func() ([]byte, []byte, error) {
		e.mu.Lock()
		defer e.mu.Unlock()
		dev := ""
		if len(args) > 0 {
			dev = args[len(args)-1]
		}
		switch {
		case cmd == "blockdev" && len(args) > 0 && args[0] == "--getro":
			return []byte("0\n"), nil, nil
		case cmd == "blkid":
			if fs := e.formats[dev]; fs != "" {
				return []byte("TYPE=" + fs + "\n"), nil, nil
			}
			return nil, nil, testingexec.FakeExitError{Status: 2}
		case strings.HasPrefix(cmd, "mkfs."):
			if e.mkfsErr != nil {
				return []byte("mkfs failed"), nil, e.mkfsErr
			}
			e.formats[dev] = strings.TrimPrefix(cmd, "mkfs.")
		}
		return nil, nil, nil
	}
	return &testingexec.FakeCmd{Argv: append([]string{cmd}, args...),
		CombinedOutputScript: []testingexec.FakeAction{run}, OutputScript: []testingexec.FakeAction{run},
		RunScript: []testingexec.FakeAction{run}}
}

func (e *scriptExec) CommandContext(ctx context.Context, cmd string, args ...string) utilexec.Cmd {
	return e.Command(cmd, args...)
}

func (e *scriptExec) LookPath(file string) (string, error) { return "/usr/sbin/" + file, nil }

func (e *scriptExec) ran(prefix string) [][]string {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out [][]string
	for _, c := range e.commands {
		if strings.HasPrefix(c[0], prefix) {
			out = append(out, c)
		}
	}
	return out
}

// rig is a driver with every service on fakes.
type rig struct {
	d       *Driver
	images  *fakeImages
	att     *fakeDaemon
	mounter *fakeMounter
	exec    *scriptExec
	dir     string
	logs    *bytes.Buffer
}

var goodSecrets = map[string]string{"userID": "csi", "userKey": "AQDkey"}

// controllerSecret writes a mounted Secret's userID and userKey files
// (--controller-secret-dir) under dir and returns their directory.
func controllerSecret(dir, id, key string) string {
	sec := filepath.Join(dir, "secret")
	os.MkdirAll(sec, 0o700)
	os.WriteFile(filepath.Join(sec, "userID"), []byte(id+"\n"), 0o600)
	os.WriteFile(filepath.Join(sec, "userKey"), []byte(key+"\n"), 0o600)
	return sec
}

func newRig(t *testing.T) *rig { t.Helper(); return newRigWith(t, nil) }

// newRigWith lets a test change the driver's config first.
func newRigWith(t *testing.T, change func(*Config)) *rig {
	t.Helper()
	dir := t.TempDir()
	conf := filepath.Join(dir, "config.json")
	os.WriteFile(conf, []byte(`[{"clusterID":"c1","monitors":["127.0.0.1:6789"]},
		{"clusterID":"ns","monitors":["127.0.0.1:6789"],"rbd":{"radosNamespace":"tenant"}},
		{"clusterID":"nomons","monitors":[]}]`), 0o600)
	r := &rig{images: newFakeImages(), att: &fakeDaemon{devs: map[int]control.Record{}},
		mounter: &fakeMounter{FakeMounter: mount.NewFakeMounter(nil)},
		exec:    &scriptExec{formats: map[string]string{}}, dir: dir, logs: &bytes.Buffer{}}
	sys := filepath.Join(dir, "sys")
	for i := range 8 {
		os.MkdirAll(filepath.Join(sys, fmt.Sprintf("nbd%d", i)), 0o755)
		os.WriteFile(filepath.Join(sys, fmt.Sprintf("nbd%d", i), "size"), []byte("2097152\n"), 0o644)
	}
	cfg := Config{NodeID: "node-1", Controller: true, Node: true, ClustersConfig: conf,
		StateDir: filepath.Join(dir, "state"), Images: r.images, Daemon: r.att,
		Mounter: mount.NewSafeFormatAndMount(r.mounter, r.exec), Nodes: DirRegistry{filepath.Join(dir, "nodes")},
		SysBlock: sys, DeviceWait: 1e9,
		Log: slog.New(slog.NewTextHandler(r.logs, &slog.HandlerOptions{Level: slog.LevelDebug}))}
	if change != nil {
		change(&cfg)
	}
	d, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	DirRegistry{filepath.Join(dir, "nodes")}.Register("node-1")
	r.d = d
	return r
}

func mountCap(fs string, mode csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fs}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode}}
}

func blockCap(mode csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode}}
}

const rwo = csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER

// create makes a volume and returns it.
func (r *rig) create(t *testing.T, name string, size int64, params map[string]string) *csi.Volume {
	t.Helper()
	if params == nil {
		params = map[string]string{"clusterID": "c1", "pool": "rbd"}
	}
	resp, err := r.d.CreateVolume(context.Background(), &csi.CreateVolumeRequest{Name: name,
		CapacityRange:      &csi.CapacityRange{RequiredBytes: size},
		VolumeCapabilities: []*csi.VolumeCapability{mountCap("ext4", rwo)}, Parameters: params, Secrets: goodSecrets})
	if err != nil {
		t.Fatal(err)
	}
	return resp.GetVolume()
}

// fakeLUKS is where the fake keeps the passphrase an image was formatted
// with (librbd keeps only its LUKS header), for tests to check.
const fakeLUKS = "fake/luks-passphrase"

func (f *fakeImages) FormatEncryption(o ceph.Options, spec ceph.ImageSpec, pass []byte) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.check(o, spec.Pool); err != nil {
		return err
	}
	i, ok := f.images[spec.String()]
	if !ok {
		return ceph.ErrImageNotFound
	}
	if i.Meta == nil {
		i.Meta = map[string]string{}
	}
	i.Meta[fakeLUKS] = string(pass)
	f.images[spec.String()] = i
	return nil
}
