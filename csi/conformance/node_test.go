package conformance

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// A volume's life as Kubernetes plays it, on real /dev/nbd devices in
// the VM: the calls the external-provisioner, external-attacher and
// kubelet make, in their order.

type volumeRig struct {
	t       *testing.T
	p       *plugin
	cc      csi.ControllerClient
	nc      csi.NodeClient
	ctx     context.Context
	dir     string
	vol     *csi.Volume
	cap     *csi.VolumeCapability
	staging string
	pubCtx  map[string]string
}

func newVolumeRig(t *testing.T) *volumeRig {
	needNode(t)
	return newVolumeRigIn(t, t.TempDir())
}

// newVolumeRigIn starts the plugin in dir with extra arguments.
func newVolumeRigIn(t *testing.T, dir string, extra ...string) *volumeRig {
	p := startPlugin(t, dir, extra...)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	t.Cleanup(cancel)
	return &volumeRig{t: t, p: p, cc: csi.NewControllerClient(p.conn), nc: csi.NewNodeClient(p.conn), ctx: ctx,
		dir: dir, staging: filepath.Join(dir, "globalmount")}
}

func fsCap(fs string, mode csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fs}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode}}
}

const rwo = csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER

func (r *volumeRig) must(what string, err error) {
	r.t.Helper()
	if err != nil {
		r.t.Fatalf("%s: %v", what, err)
	}
}

func (r *volumeRig) create(name string, size int64, c *csi.VolumeCapability) {
	r.t.Helper()
	resp, err := r.cc.CreateVolume(r.ctx, &csi.CreateVolumeRequest{Name: name, CapacityRange: &csi.CapacityRange{RequiredBytes: size},
		VolumeCapabilities: []*csi.VolumeCapability{c}, Parameters: map[string]string{"clusterID": "dev", "pool": "rbd"},
		Secrets: secrets()})
	r.must("CreateVolume", err)
	r.vol, r.cap = resp.Volume, c
}

// attach is what the attacher and kubelet do before a pod starts.
func (r *volumeRig) attach() {
	r.t.Helper()
	resp, err := r.cc.ControllerPublishVolume(r.ctx, &csi.ControllerPublishVolumeRequest{VolumeId: r.vol.VolumeId,
		NodeId: "sanity-node", VolumeCapability: r.cap})
	r.must("ControllerPublish", err)
	r.pubCtx = resp.PublishContext
	os.MkdirAll(r.staging, 0o750)
	t0 := time.Now()
	_, err = r.nc.NodeStageVolume(r.ctx, &csi.NodeStageVolumeRequest{VolumeId: r.vol.VolumeId, StagingTargetPath: r.staging,
		VolumeCapability: r.cap, Secrets: secrets(), VolumeContext: r.vol.VolumeContext, PublishContext: r.pubCtx})
	r.must("NodeStage", err)
	r.t.Logf("NodeStage took %s", time.Since(t0).Round(time.Millisecond))
}

func (r *volumeRig) publish(pod string, ro bool) string {
	r.t.Helper()
	target := filepath.Join(r.dir, "pods", pod, "mount")
	_, err := r.nc.NodePublishVolume(r.ctx, &csi.NodePublishVolumeRequest{VolumeId: r.vol.VolumeId, StagingTargetPath: r.staging,
		TargetPath: target, VolumeCapability: r.cap, Readonly: ro, PublishContext: r.pubCtx, VolumeContext: r.vol.VolumeContext})
	r.must("NodePublish "+pod, err)
	return target
}

func (r *volumeRig) unpublish(target string) {
	r.t.Helper()
	_, err := r.nc.NodeUnpublishVolume(r.ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: r.vol.VolumeId, TargetPath: target})
	r.must("NodeUnpublish", err)
}

func (r *volumeRig) detach() {
	r.t.Helper()
	t0 := time.Now()
	_, err := r.nc.NodeUnstageVolume(r.ctx, &csi.NodeUnstageVolumeRequest{VolumeId: r.vol.VolumeId, StagingTargetPath: r.staging})
	r.must("NodeUnstage", err)
	r.t.Logf("NodeUnstage took %s", time.Since(t0).Round(time.Millisecond))
	_, err = r.cc.ControllerUnpublishVolume(r.ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: r.vol.VolumeId, NodeId: "sanity-node"})
	r.must("ControllerUnpublish", err)
}

// mapped lists what the node daemon serves, as ceph-csi would ask.
func (r *volumeRig) mapped() string {
	out, _ := exec.Command(binary, "--state-dir", filepath.Join(r.dir, "state"), "list-mapped", "--format", "json").Output()
	return strings.TrimSpace(string(out))
}

func run(t *testing.T, name string, args ...string) string {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Env = cluster.c.Env()
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%s %v: %v\n%s", name, args, err, out)
	}
	return string(out)
}

// imageCount is how many images the pool holds.
func imageCount(t *testing.T) int {
	return len(strings.Fields(run(t, "rbd", "ls", "rbd")))
}

func TestVolumeLifecycle(t *testing.T) {
	r := newVolumeRig(t)
	before := imageCount(t)
	r.create("pvc-life", 128<<20, fsCap("ext4", rwo))
	r.attach()
	a, b := r.publish("a", false), r.publish("b", false) // two pods on one node
	r.must("write", os.WriteFile(filepath.Join(a, "data"), []byte("written by pod a"), 0o644))
	if got, err := os.ReadFile(filepath.Join(b, "data")); err != nil || string(got) != "written by pod a" {
		t.Fatalf("pod b reads %q %v", got, err)
	}
	r.unpublish(a)
	r.unpublish(b)
	r.detach()
	if m := r.mapped(); m != "[]" {
		t.Fatalf("still mapped after unstage: %s", m)
	}
	// Rescheduled: staged again, the data is there.
	r.attach()
	c := r.publish("c", false)
	if got, err := os.ReadFile(filepath.Join(c, "data")); err != nil || string(got) != "written by pod a" {
		t.Fatalf("after restage: %q %v", got, err)
	}
	r.unpublish(c)
	r.detach()
	_, err := r.cc.DeleteVolume(r.ctx, &csi.DeleteVolumeRequest{VolumeId: r.vol.VolumeId, Secrets: secrets()})
	r.must("DeleteVolume", err)
	if n := imageCount(t); n != before {
		t.Fatalf("%d images after delete, %d before", n, before)
	}
}

func TestRetainAndStaticVolume(t *testing.T) {
	r := newVolumeRig(t)
	r.create("pvc-retain", 320<<20, fsCap("xfs", rwo)) // mkfs.xfs wants 300 MB
	r.attach()
	a := r.publish("a", false)
	r.must("write", os.WriteFile(filepath.Join(a, "kept"), []byte("retained"), 0o644))
	r.unpublish(a)
	r.detach()
	// Reclaim policy Retain: no DeleteVolume; the image stays.
	image := r.vol.VolumeContext["imageName"]
	run(t, "rbd", "info", "rbd/"+image)
	// A static PV: a handle written by hand naming the existing image.
	r.vol = &csi.Volume{VolumeId: "nbd1/dev/rbd//" + image}
	r.attach()
	b := r.publish("b", true)
	if got, err := os.ReadFile(filepath.Join(b, "kept")); err != nil || string(got) != "retained" {
		t.Fatalf("static volume reads %q %v", got, err)
	}
	if err := os.WriteFile(filepath.Join(b, "x"), nil, 0o644); err == nil {
		t.Fatal("a read-only publish took a write")
	}
	r.unpublish(b)
	r.detach()
}

// fioRun is fio writing 4k at random with crc32c verify on a file.
type fioRun struct {
	out  bytes.Buffer
	err  error
	done chan struct{}
}

func fio(t *testing.T, file, size string, extra ...string) *fioRun {
	args := append([]string{"--name=verify", "--filename=" + file, "--size=" + size, "--ioengine=libaio",
		"--direct=1", "--rw=randwrite", "--bs=4k", "--iodepth=16", "--verify=crc32c", "--verify_fatal=1",
		"--do_verify=1", "--output-format=terse", "--terse-version=3"}, extra...)
	f := &fioRun{done: make(chan struct{})}
	cmd := exec.Command("fio", args...)
	cmd.Stdout, cmd.Stderr = &f.out, &f.out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { f.err = cmd.Wait(); close(f.done) }()
	return f
}

func (f *fioRun) running() bool {
	select {
	case <-f.done:
		return false
	default:
		return true
	}
}

// wait returns fio's output and whether it exited 0 with no job error.
func (f *fioRun) wait() (string, bool) {
	<-f.done
	out := f.out.String()
	ok := f.err == nil && strings.Contains(out, "3;")
	for _, l := range strings.Split(out, "\n") {
		if fs := strings.Split(l, ";"); len(fs) > 5 && fs[0] == "3" && fs[4] != "0" {
			ok = false
		}
	}
	return out, ok
}

func TestOnlineExpand(t *testing.T) {
	for _, fs := range []string{"ext4", "xfs"} {
		t.Run(fs, func(t *testing.T) {
			r := newVolumeRig(t)
			r.create("pvc-grow-"+fs, 320<<20, fsCap(fs, rwo))
			r.attach()
			target := r.publish("a", false)
			before := fsSize(t, target)
			// One pass (about half a minute under TCG) outlasts the
			// expand (seconds); the running() check below says if it ever
			// did not.
			f := fio(t, filepath.Join(target, "f"), "16M")
			time.Sleep(2 * time.Second)
			resp, err := r.cc.ControllerExpandVolume(r.ctx, &csi.ControllerExpandVolumeRequest{VolumeId: r.vol.VolumeId,
				CapacityRange: &csi.CapacityRange{RequiredBytes: 640 << 20}, VolumeCapability: r.cap, Secrets: secrets()})
			r.must("ControllerExpand", err)
			if !resp.NodeExpansionRequired {
				t.Fatal("a filesystem needs node expansion")
			}
			_, err = r.nc.NodeExpandVolume(r.ctx, &csi.NodeExpandVolumeRequest{VolumeId: r.vol.VolumeId, VolumePath: target,
				StagingTargetPath: r.staging, VolumeCapability: r.cap, CapacityRange: &csi.CapacityRange{RequiredBytes: 640 << 20}})
			r.must("NodeExpand", err)
			after := fsSize(t, target)
			if !f.running() {
				t.Fatal("fio ended before the expand: nothing was tested under I/O")
			}
			out, ok := f.wait()
			if !ok {
				t.Fatalf("fio during the expand:\n%s", out)
			}
			if after < before+250<<20 {
				t.Fatalf("filesystem %d -> %d bytes: not grown", before, after)
			}
			t.Logf("%s grew online from %d to %d MiB under fio verify", fs, before>>20, after>>20)
			r.unpublish(target)
			r.detach()
		})
	}
}

func fsSize(t *testing.T, path string) uint64 {
	var st syscall.Statfs_t
	if err := syscall.Statfs(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks * uint64(st.Bsize)
}

// TestRestartSurvival: every process of the node plugin is killed
// (SIGKILL, as a container restart does) or stopped (SIGTERM, a rolling
// upgrade) while a published ext4 volume takes writes; the plugin is
// started again on the same state directory. The application must see
// no I/O error and the filesystem must stay read-write. The longest
// single write+fdatasync is the stall the restart cost the application.
func TestRestartSurvival(t *testing.T) {
	for _, sig := range []syscall.Signal{syscall.SIGKILL, syscall.SIGTERM} {
		t.Run(sig.String(), func(t *testing.T) {
			r := newVolumeRig(t)
			r.create("pvc-restart-"+strings.ReplaceAll(sig.String(), " ", ""), 256<<20, fsCap("ext4", rwo))
			r.attach()
			target := r.publish("a", false)
			longest := acrossEvent(t, target, "the restart", func() {
				t0 := time.Now()
				r.p.signal(sig)
				time.Sleep(time.Second)
				r.p.start()
				t.Logf("%s: plugin back in %s", sig, time.Since(t0).Round(time.Millisecond))
			})
			t.Logf("%s: longest write+fdatasync across the restart: %s", sig, longest.Round(time.Millisecond))
			r.unpublish(target)
			r.detach()
		})
	}
}

// acrossEvent runs fio verify and an fdatasync loop on the mounted
// target while event happens, and checks what the application saw: no
// I/O error, every block read back, the filesystem read-write. It
// returns the longest single write+fdatasync: the stall the event cost.
// One pass of writes then verify: the I/O stalls during the event, so
// fio is still writing when it is over, and every block written before,
// during and after it is read back.
func acrossEvent(t *testing.T, target, what string, event func()) time.Duration {
	t.Helper()
	f := fio(t, filepath.Join(target, "f"), "32M")
	stop := make(chan struct{})
	stall := make(chan time.Duration, 1)
	werr := make(chan error, 1)
	go func() { d, err := writer(filepath.Join(target, "w"), stop); stall <- d; werr <- err }()
	time.Sleep(3 * time.Second)
	event()
	if !f.running() {
		t.Fatalf("fio ended before %s was over: nothing was tested under I/O", what)
	}
	out, ok := f.wait()
	close(stop)
	longest := <-stall
	if err := <-werr; err != nil {
		t.Fatalf("the application saw an I/O error: %v", err)
	}
	if !ok {
		t.Fatalf("fio across %s:\n%s", what, out)
	}
	if !mountedRW(t, target) {
		t.Fatal("the filesystem is no longer read-write")
	}
	return longest
}

// writer appends 4 KiB and fdatasyncs in a loop until stop; it returns
// the longest iteration and the first error.
func writer(path string, stop chan struct{}) (time.Duration, error) {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	buf := bytes.Repeat([]byte("w"), 4096)
	var longest time.Duration
	for i := 0; ; i++ {
		select {
		case <-stop:
			return longest, nil
		default:
		}
		t0 := time.Now()
		if _, err := f.WriteAt(buf, int64(i%1024)*4096); err != nil {
			return longest, err
		}
		if err := syscall.Fdatasync(int(f.Fd())); err != nil {
			return longest, err
		}
		longest = max(longest, time.Since(t0))
		time.Sleep(10 * time.Millisecond)
	}
}

func mountedRW(t *testing.T, target string) bool {
	b, err := os.ReadFile("/proc/self/mounts")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) > 3 && f[1] == target {
			return strings.HasPrefix(f[3], "rw")
		}
	}
	return false
}

// TestBadInput: each mistake gets a clear error with the right code, and
// leaves nothing behind on the node or in the cluster.
func TestBadInput(t *testing.T) {
	r := newVolumeRig(t)
	before := imageCount(t)
	create := func(params map[string]string, sec map[string]string, c *csi.VolumeCapability) error {
		_, err := r.cc.CreateVolume(r.ctx, &csi.CreateVolumeRequest{Name: "pvc-bad", CapacityRange: &csi.CapacityRange{RequiredBytes: 64 << 20},
			VolumeCapabilities: []*csi.VolumeCapability{c}, Parameters: params, Secrets: sec})
		return err
	}
	// A well-formed key the cluster does not know.
	wrongKey := map[string]string{"userID": "admin", "userKey": strings.TrimSpace(run(t, "ceph-authtool", "--gen-print-key"))}
	for _, tc := range []struct {
		name string
		err  error
		code codes.Code
		says string
	}{
		{"unknown clusterID", create(map[string]string{"clusterID": "elsewhere"}, secrets(), fsCap("ext4", rwo)), codes.InvalidArgument, "elsewhere"},
		{"wrong key", create(map[string]string{"clusterID": "dev"}, wrongKey, fsCap("ext4", rwo)), codes.PermissionDenied, "permission denied"},
		{"missing pool", create(map[string]string{"clusterID": "dev", "pool": "nopool"}, secrets(), fsCap("ext4", rwo)), codes.InvalidArgument, "nopool"},
		{"bad fstype", create(map[string]string{"clusterID": "dev"}, secrets(), fsCap("zfs", rwo)), codes.InvalidArgument, "zfs"},
	} {
		if status.Code(tc.err) != tc.code || !strings.Contains(tc.err.Error(), tc.says) {
			t.Errorf("%s: %v, want %v saying %q", tc.name, tc.err, tc.code, tc.says)
		}
		if tc.err != nil && strings.Contains(tc.err.Error(), wrongKey["userKey"]) {
			t.Errorf("%s: the key is in the error", tc.name)
		}
	}
	if n := imageCount(t); n != before {
		t.Fatalf("refused creates left %d images", n-before)
	}
	// Node side: an unmappable image (none by that name) and a wrong key.
	os.MkdirAll(r.staging, 0o750)
	stage := func(id string, sec map[string]string) error {
		_, err := r.nc.NodeStageVolume(r.ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: r.staging,
			VolumeCapability: fsCap("ext4", rwo), Secrets: sec})
		return err
	}
	if err := stage("nbd1/dev/rbd//no-such-image", secrets()); status.Code(err) != codes.NotFound {
		t.Errorf("unmappable image: %v, want NotFound", err)
	}
	run(t, "rbd", "create", "--size", "64M", "rbd/bad-key-img")
	if err := stage("nbd1/dev/rbd//bad-key-img", wrongKey); status.Code(err) != codes.PermissionDenied {
		t.Errorf("stage with a wrong key: %v, want PermissionDenied", err)
	}
	if m := r.mapped(); m != "[]" {
		t.Errorf("failed stages left devices: %s", m)
	}
	if ents, _ := os.ReadDir(r.staging); len(ents) != 0 {
		t.Errorf("failed stages left %v in the staging path", ents)
	}
	if ents, _ := os.ReadDir(filepath.Join(r.dir, "state", "csi", "volumes")); len(ents) != 0 {
		t.Errorf("failed stages left stage records: %v", ents)
	}
	if out := run(t, "rbd", "status", "rbd/bad-key-img"); strings.Contains(out, "watcher=") {
		t.Errorf("a failed stage left a watcher: %s", out)
	}
}
