package conformance

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Clone depth, flattens and the controller's journal, against the real
// binary and cluster. These need no kernel NBD: they run on the host in
// `make test` (the VM runs them again).

// controller is a plugin and a controller client for these tests.
type controller struct {
	t   *testing.T
	p   *plugin
	cc  csi.ControllerClient
	ctx context.Context
}

func newController(t *testing.T, extra ...string) *controller {
	if onNode() {
		t.Skip("controller-only: runs on the host, in make test's go test, not again under TCG")
	}
	dir := t.TempDir()
	p := startPlugin(t, dir, extra...)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	t.Cleanup(cancel)
	return &controller{t: t, p: p, cc: csi.NewControllerClient(p.conn), ctx: ctx}
}

// reconnect follows a restarted plugin.
func (c *controller) reconnect() { c.cc = csi.NewControllerClient(c.p.conn) }

var blockRWO = &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
	AccessMode: &csi.VolumeCapability_AccessMode{Mode: rwo}}

func (c *controller) snapshot(name, source string) *csi.Snapshot {
	c.t.Helper()
	return c.snapshotReady(name, source, true)
}

// snapshotReady takes a snapshot; with wait, it polls until the
// snapshot is ready to use, as the snapshotter does.
func (c *controller) snapshotReady(name, source string, wait bool) *csi.Snapshot {
	c.t.Helper()
	for {
		resp, err := c.cc.CreateSnapshot(c.ctx, &csi.CreateSnapshotRequest{Name: name, SourceVolumeId: source,
			Secrets: secrets(), Parameters: map[string]string{"clusterID": "dev"}})
		if err == nil && (resp.Snapshot.ReadyToUse || !wait) {
			return resp.Snapshot
		}
		if err != nil && status.Code(err) != codes.Aborted && status.Code(err) != codes.ResourceExhausted {
			c.t.Fatalf("CreateSnapshot %s: %v", name, err)
		}
		time.Sleep(time.Second) // as the snapshotter polls until ready
	}
}

// restore creates a volume from a source, retrying Aborted as the
// provisioner does; it returns the volume and how many times it was
// told to wait.
func (c *controller) restore(name string, src *csi.VolumeContentSource, size int64, capab *csi.VolumeCapability) (*csi.Volume, int) {
	c.t.Helper()
	for aborted := 0; ; aborted++ {
		resp, err := c.cc.CreateVolume(c.ctx, &csi.CreateVolumeRequest{Name: name,
			CapacityRange: &csi.CapacityRange{RequiredBytes: size}, VolumeCapabilities: []*csi.VolumeCapability{capab},
			Parameters: map[string]string{"clusterID": "dev", "pool": "rbd"}, Secrets: secrets(), VolumeContentSource: src})
		if err == nil {
			return resp.Volume, aborted
		}
		if status.Code(err) != codes.Aborted {
			c.t.Fatalf("CreateVolume %s: %v", name, err)
		}
		if aborted%10 == 0 {
			c.t.Logf("CreateVolume %s: %v", name, status.Convert(err).Message())
		}
		time.Sleep(time.Second)
	}
}

func snapSrc(id string) *csi.VolumeContentSource {
	return &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
		Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: id}}}
}

func volSrc(id string) *csi.VolumeContentSource {
	return &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{
		Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: id}}}
}

func imageOf(volID string) string { return volID[strings.LastIndex(volID, "/")+1:] }

// rbdInfo is what `rbd info --format json` says of the parent.
type rbdInfo struct {
	ID     string `json:"id"`
	Parent *struct {
		Pool     string `json:"pool"`
		Image    string `json:"image"`
		Snapshot string `json:"snapshot"`
		Trash    bool   `json:"trash"`
	} `json:"parent"`
}

// depth walks an image's parent chain with the rbd tool: the ground
// truth, independent of the driver's own walk.
func depth(t *testing.T, spec string) int {
	t.Helper()
	n := 0
	for ; n < 64; n++ {
		var info rbdInfo
		if err := json.Unmarshal([]byte(run(t, "rbd", "info", "--format", "json", spec)), &info); err != nil {
			t.Fatal(err)
		}
		if info.Parent == nil {
			return n
		}
		spec = info.Parent.Pool + "/" + info.Parent.Image + "@" + info.Parent.Snapshot
	}
	t.Fatalf("%s: chain longer than 64", spec)
	return n
}

// staticImage imports size bytes of random data as an image (a static
// volume's image) and returns its volume ID and the data.
func staticImage(t *testing.T, name string, size int) (string, []byte) {
	t.Helper()
	data := make([]byte, size)
	rand.Read(data)
	f := filepath.Join(t.TempDir(), "data")
	os.WriteFile(f, data, 0o600)
	run(t, "rbd", "import", "--no-progress", "--image-feature", "layering,exclusive-lock,object-map,fast-diff,deep-flatten",
		f, "rbd/"+name)
	return "nbd1/dev/rbd//" + name, data
}

func export(t *testing.T, image string) []byte {
	t.Helper()
	f := filepath.Join(t.TempDir(), "export")
	run(t, "rbd", "export", "--no-progress", "rbd/"+image, f)
	b, err := os.ReadFile(f)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func (c *controller) deleteVolume(id string) {
	c.t.Helper()
	_, err := c.cc.DeleteVolume(c.ctx, &csi.DeleteVolumeRequest{VolumeId: id, Secrets: secrets()})
	if err != nil {
		c.t.Fatalf("DeleteVolume %s: %v", id, err)
	}
}

func (c *controller) deleteSnapshot(id string) {
	c.t.Helper()
	_, err := c.cc.DeleteSnapshot(c.ctx, &csi.DeleteSnapshotRequest{SnapshotId: id, Secrets: secrets()})
	if err != nil {
		c.t.Fatalf("DeleteSnapshot %s: %v", id, err)
	}
}

// allGone waits until none of images is in the pool, no deleted
// volume's image is kept (csi-gone-*), and the trash is empty: what
// the test made is gone, whatever other tests sharing the cluster left.
func allGone(t *testing.T, images []string, within time.Duration) time.Duration {
	t.Helper()
	t0 := time.Now()
	for {
		var left []string
		for _, img := range strings.Fields(run(t, "rbd", "ls", "rbd")) {
			if slices.Contains(images, img) || strings.HasPrefix(img, "csi-gone-") {
				left = append(left, img)
			}
		}
		trash := strings.TrimSpace(run(t, "rbd", "trash", "ls", "rbd"))
		if len(left) == 0 && trash == "" {
			return time.Since(t0)
		}
		if time.Since(t0) > within {
			// What keeps each: its snapshots (and their namespaces), and
			// who has it open.
			var why []string
			for _, img := range left {
				out := func(args ...string) string {
					cmd := exec.Command("rbd", args...)
					cmd.Env = cluster.c.Env()
					b, _ := cmd.CombinedOutput()
					return string(b)
				}
				why = append(why, img+":\n"+out("snap", "ls", "--all", "rbd/"+img)+out("status", "rbd/"+img))
			}
			t.Fatalf("after %s the pool still holds %q and its trash %q\n%s", within, left, trash, strings.Join(why, "\n"))
		}
		time.Sleep(time.Second)
	}
}

func imagesOf(volIDs ...string) []string {
	var out []string
	for _, v := range volIDs {
		out = append(out, imageOf(v))
	}
	return out
}

// Chains of restores, each from a snapshot of the one before, with
// --rbdhardmaxclonedepth=2 and one librbd management op at a time (so
// flattens take seconds): no volume returned is deeper than 2 (rbd info
// walks the chain), every one holds the first's data byte for byte,
// and with everything deleted the pool and its trash are empty.
//
// With --rbdsoftmaxclonedepth=2, the snapshot of a depth-2 volume is not
// ready and its restore answers Aborted until the source is flattened.
// With --rbdsoftmaxclonedepth=1, volumes past it are flattened in the
// background and every one ends at depth 1 or 0; a snapshot waits for
// its image's flatten (librbd loses data otherwise: flatten.go).
func TestRestoreChainDepth(t *testing.T) {
	needCluster(t)
	run(t, "rbd", "config", "pool", "set", "rbd", "rbd_concurrent_management_ops", "1")
	t.Cleanup(func() { run(t, "rbd", "config", "pool", "remove", "rbd", "rbd_concurrent_management_ops") })
	t.Run("hard", func(t *testing.T) { restoreChain(t, 2) })
	t.Run("soft", func(t *testing.T) { restoreChain(t, 1) })
}

func restoreChain(t *testing.T, soft int) {
	c := newController(t, fmt.Sprintf("--rbdsoftmaxclonedepth=%d", soft), "--rbdhardmaxclonedepth=2",
		"--sweep-interval=5s", "--flatten-progress-interval=1s")
	pfx := fmt.Sprintf("chain%d", soft)
	src, data := staticImage(t, pfx+"-0", 256<<20)
	vols := []string{src}
	var snaps []string
	waited, notReady := 0, 0
	var last time.Time
	for i := 1; i <= 5; i++ {
		// Each snapshot is restored at once, ready or not, as a user
		// racing the flattens would.
		s := c.snapshotReady(fmt.Sprintf("%s-snap-%d", pfx, i), vols[i-1], false)
		if !s.ReadyToUse {
			notReady++
		}
		snaps = append(snaps, s.SnapshotId)
		v, aborted := c.restore(fmt.Sprintf("%s-vol-%d", pfx, i), snapSrc(s.SnapshotId), 0, blockRWO)
		waited += aborted
		last = time.Now()
		if d := depth(t, "rbd/"+imageOf(v.VolumeId)); d > 2 {
			t.Fatalf("volume %d returned with depth %d, past the hard depth 2", i, d)
		}
		vols = append(vols, v.VolumeId)
	}
	t.Logf("soft depth %d: CreateVolume answered Aborted %d times in a chain of 5 (the provisioner's retries); %d snapshots were not ready when taken",
		soft, waited, notReady)
	if soft == 2 && (waited == 0 || notReady == 0) {
		t.Fatal("the chain never met the hard depth: nothing was tested")
	}
	for {
		deepest := 0
		for _, v := range vols[1:] {
			deepest = max(deepest, depth(t, "rbd/"+imageOf(v)))
		}
		if deepest <= soft {
			break
		}
		if time.Since(last) > 5*time.Minute {
			t.Fatalf("volumes still at depth %d five minutes after the chain", deepest)
		}
		time.Sleep(time.Second)
	}
	t.Logf("soft depth %d: every volume at or below it %s after the last CreateVolume", soft, time.Since(last).Round(time.Millisecond))
	var took []string
	for _, l := range strings.Split(readFile(c.p.log), "\n") {
		if i := strings.Index(l, "took="); strings.Contains(l, `msg="flatten done"`) && i > 0 {
			took = append(took, strings.Fields(l[i+5:])[0])
		}
	}
	t.Logf("soft depth %d: the controller's flattens of 256 MiB volumes (one librbd op at a time) took %s",
		soft, strings.Join(took, ", "))
	for i, v := range vols[1:] {
		if got := export(t, imageOf(v)); !bytes.Equal(got, data) {
			n := 0
			for o := 0; o < len(data); o += 4 << 20 {
				if !bytes.Equal(got[o:o+4<<20], data[o:o+4<<20]) {
					n++
				}
			}
			t.Errorf("volume %d of the chain does not hold the first volume's data: %d of %d objects differ", i+1, n, len(data)>>22)
		}
	}
	if t.Failed() {
		t.FailNow()
	}
	// Delete in creation order: volumes first (kept while their
	// snapshots live), then the snapshots, then the static image (not
	// the driver's to delete).
	for _, v := range vols[1:] {
		c.deleteVolume(v)
	}
	for _, s := range snaps {
		c.deleteSnapshot(s)
	}
	run(t, "rbd", "rm", "--no-progress", "rbd/"+pfx+"-0")
	t.Logf("pool and trash empty %s after the last delete", allGone(t, imagesOf(vols...), 3*time.Minute).Round(time.Millisecond))
	noKeyIn(t, c.p)
}

// A controller killed in the middle of a background flatten: the
// flatten is in the journal, and the restarted controller finishes it.
func TestControllerKilledMidFlatten(t *testing.T) {
	needCluster(t)
	c := newController(t, "--rbdsoftmaxclonedepth=1", "--sweep-interval=3s", "--flatten-progress-interval=500ms")
	src, data := staticImage(t, "midflat-0", 256<<20)
	s1 := c.snapshot("midflat-s1", src)
	v1, _ := c.restore("midflat-v1", snapSrc(s1.SnapshotId), 0, blockRWO)
	s2 := c.snapshot("midflat-s2", v1.VolumeId)
	// Depth 2, past the soft depth 1: flattened in the background.
	v2, _ := c.restore("midflat-v2", snapSrc(s2.SnapshotId), 0, blockRWO)
	img := imageOf(v2.VolumeId)
	var info rbdInfo
	json.Unmarshal([]byte(run(t, "rbd", "info", "--format", "json", "rbd/"+img)), &info)
	key := "flatten/" + info.ID
	for i := 0; !strings.Contains(readFile(c.p.log), "flatten started"); i++ {
		if i > 3000 {
			t.Fatal("no flatten started")
		}
		time.Sleep(10 * time.Millisecond)
	}
	c.p.signal(syscall.SIGKILL)
	if depth(t, "rbd/"+img) == 0 {
		t.Fatal("the flatten finished before the kill: nothing was tested")
	}
	if out, err := rados(t, "getomapval", "rbd-nbd-go.csi", key); err != nil {
		t.Fatalf("the killed controller's flatten is not in the journal: %v %s", err, out)
	}
	t0 := time.Now()
	c.p.start()
	c.reconnect()
	for depth(t, "rbd/"+img) != 0 {
		if time.Since(t0) > 5*time.Minute {
			t.Fatalf("the restarted controller did not finish the flatten:\n%s", tail(readFile(c.p.log), 20))
		}
		time.Sleep(time.Second)
	}
	t.Logf("restarted controller finished the flatten %s after its start", time.Since(t0).Round(time.Millisecond))
	if !strings.Contains(readFile(c.p.log), "resuming an owed flatten") {
		t.Fatal("the log does not say the flatten was resumed")
	}
	if _, err := rados(t, "getomapval", "rbd-nbd-go.csi", key); err == nil {
		t.Fatal("the finished flatten stays in the journal")
	}
	if got := export(t, img); !bytes.Equal(got, data) {
		t.Fatal("the flattened volume does not hold the data")
	}
	c.deleteVolume(v2.VolumeId)
	c.deleteVolume(v1.VolumeId)
	c.deleteSnapshot(s2.SnapshotId)
	c.deleteSnapshot(s1.SnapshotId)
	run(t, "rbd", "rm", "--no-progress", "rbd/midflat-0")
	allGone(t, imagesOf(src, v1.VolumeId, v2.VolumeId), 3*time.Minute)
	noKeyIn(t, c.p)
}

func readFile(p string) string {
	b, _ := os.ReadFile(p)
	return string(b)
}

func rados(t *testing.T, args ...string) (string, error) {
	cmd := exec.Command("rados", append([]string{"-p", "rbd"}, args...)...)
	cmd.Env = cluster.c.Env()
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// noKeyIn checks that the Ceph key reached no log the plugin wrote.
func noKeyIn(t *testing.T, p *plugin) {
	t.Helper()
	for _, f := range []string{p.log, filepath.Join(p.dir, "state", "daemon.log")} {
		if strings.Contains(readFile(f), cluster.key) {
			t.Fatalf("the Ceph key is in %s", f)
		}
	}
}

// Snapshot, restore, delete the snapshot, over and over, with
// --minsnapshotsonimage=1 --maxsnapshotsonimage=2 (ceph-csi #4069 got
// stuck past 450 this way): the trashed snapshots the restores hold are
// freed by flattening the restores, CreateSnapshot waits with
// ResourceExhausted meanwhile, and the loop never gets stuck.
func TestManySnapshotsOfOneSource(t *testing.T) {
	needCluster(t)
	c := newController(t, "--minsnapshotsonimage=1", "--maxsnapshotsonimage=2", "--sweep-interval=5s")
	// Flattens one object at a time, so a round outpaces them.
	run(t, "rbd", "config", "pool", "set", "rbd", "rbd_concurrent_management_ops", "1")
	t.Cleanup(func() { run(t, "rbd", "config", "pool", "remove", "rbd", "rbd_concurrent_management_ops") })
	src, data := staticImage(t, "many-0", 128<<20)
	var vols []string
	refused := 0
	for i := range 8 {
		var s *csi.Snapshot
		for try := 0; s == nil; try++ {
			resp, err := c.cc.CreateSnapshot(c.ctx, &csi.CreateSnapshotRequest{Name: fmt.Sprintf("many-s%d", i),
				SourceVolumeId: src, Secrets: secrets(), Parameters: map[string]string{"clusterID": "dev"}})
			switch {
			case err == nil:
				s = resp.Snapshot
			case status.Code(err) == codes.ResourceExhausted && try < 120:
				refused++
				time.Sleep(time.Second)
			default:
				t.Fatalf("snapshot %d: %v", i, err)
			}
		}
		v, _ := c.restore(fmt.Sprintf("many-v%d", i), snapSrc(s.SnapshotId), 0, blockRWO)
		vols = append(vols, v.VolumeId)
		c.deleteSnapshot(s.SnapshotId)
	}
	snaps := strings.Count(run(t, "rbd", "snap", "ls", "--all", "rbd/many-0"), "trash")
	if snaps > 2 {
		t.Fatalf("%d snapshots on the source, past --maxsnapshotsonimage", snaps)
	}
	t.Logf("8 rounds of snapshot, restore, delete: CreateSnapshot waited %d times; %d trashed snapshots left on the source",
		refused, snaps)
	// Whether the limit is met depends on how fast the flattens of the
	// restores go (the unit test holds them back to be sure); the loop
	// must not get stuck either way, nor pass the limit.
	if got := export(t, imageOf(vols[len(vols)-1])); !bytes.Equal(got, data) {
		t.Fatal("the last restore does not hold the source's data")
	}
	for _, v := range vols {
		c.deleteVolume(v)
	}
	run(t, "rbd", "rm", "--no-progress", "rbd/many-0")
	allGone(t, imagesOf(append(vols, src)...), 3*time.Minute)
}
