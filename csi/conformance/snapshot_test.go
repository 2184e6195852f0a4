package conformance

import (
	"bytes"
	"crypto/rand"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
)

// Snapshots, restores and clones of mounted filesystems on real
// /dev/nbd devices in the VM: the data each holds, byte for byte, the
// node's filesystem freeze around a snapshot, every delete order, and
// the times beside ceph-csi's commands for the same steps.

// another is a second volume on the same plugin, with its own staging
// path.
func (r *volumeRig) another(name string) *volumeRig {
	v := *r
	v.vol, v.pubCtx = nil, nil
	v.staging = filepath.Join(r.dir, name+"-globalmount")
	return &v
}

// createFrom makes the rig's volume from a snapshot or volume.
func (r *volumeRig) createFrom(name string, size int64, c *csi.VolumeCapability, src *csi.VolumeContentSource) {
	r.t.Helper()
	resp, err := r.cc.CreateVolume(r.ctx, &csi.CreateVolumeRequest{Name: name, CapacityRange: &csi.CapacityRange{RequiredBytes: size},
		VolumeCapabilities: []*csi.VolumeCapability{c}, Parameters: map[string]string{"clusterID": "dev", "pool": "rbd"},
		Secrets: secrets(), VolumeContentSource: src})
	r.must("CreateVolume "+name, err)
	r.vol, r.cap = resp.Volume, c
}

func (r *volumeRig) snapshot(name string) *csi.Snapshot {
	r.t.Helper()
	resp, err := r.cc.CreateSnapshot(r.ctx, &csi.CreateSnapshotRequest{Name: name, SourceVolumeId: r.vol.VolumeId,
		Secrets: secrets(), Parameters: map[string]string{"clusterID": "dev"}})
	r.must("CreateSnapshot "+name, err)
	if !resp.Snapshot.ReadyToUse {
		r.t.Fatalf("snapshot %s is not ready", name)
	}
	return resp.Snapshot
}

func (r *volumeRig) delete() {
	r.t.Helper()
	_, err := r.cc.DeleteVolume(r.ctx, &csi.DeleteVolumeRequest{VolumeId: r.vol.VolumeId, Secrets: secrets()})
	r.must("DeleteVolume", err)
}

func randomFile(t *testing.T, path string, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	rand.Read(b)
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return b
}

func sameFile(t *testing.T, path string, want []byte, what string) {
	t.Helper()
	got, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("%s: %s holds other bytes than it should", what, path)
	}
}

func fsTotal(t *testing.T, path string) uint64 {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks * uint64(st.Bsize)
}

func TestSnapshotRestoreCloneMounted(t *testing.T) {
	src := newVolumeRig(t)
	src.create("pvc-snap-src", 256<<20, fsCap("ext4", rwo))
	src.attach()
	a := src.publish("src", false)
	before := randomFile(t, filepath.Join(a, "data"), 8<<20)
	// Written but not synced: the freeze around the snapshot must flush
	// it for the snapshot to hold it.
	snap := src.snapshot("snap-mounted")
	log := readFile(filepath.Join(src.p.dir, "state", "daemon.log"))
	if !strings.Contains(log, "snapshot quiesce hook") || !strings.Contains(log, "quiesce=true target="+src.dir) {
		t.Fatalf("the node did not freeze the volume's filesystem around the snapshot; daemon log:\n%s", tail(log, 10))
	}
	after := randomFile(t, filepath.Join(a, "data"), 8<<20)
	randomFile(t, filepath.Join(a, "later"), 4096)

	// Restored larger: the snapshot's bytes, a filesystem grown to the
	// new size before the mount was handed out.
	rs := src.another("restored")
	rs.createFrom("pvc-restored", 512<<20, fsCap("ext4", rwo), snapSrc(snap.SnapshotId))
	rs.attach()
	ra := rs.publish("restored", false)
	sameFile(t, filepath.Join(ra, "data"), before, "the restore")
	if _, err := os.Stat(filepath.Join(ra, "later")); err == nil {
		t.Fatal("the restore holds a file written after the snapshot")
	}
	if total := fsTotal(t, ra); total < 450<<20 {
		t.Fatalf("the restored filesystem is %d bytes: not grown to the 512 MiB volume", total)
	}

	// A clone of the mounted source: its data as of the call.
	cl := src.another("clone")
	cl.createFrom("pvc-clone", 256<<20, fsCap("ext4", rwo), volSrc(src.vol.VolumeId))
	cl.attach()
	ca := cl.publish("clone", false)
	sameFile(t, filepath.Join(ca, "data"), after, "the clone")
	if _, err := os.Stat(filepath.Join(ca, "later")); err != nil {
		t.Fatalf("the clone lacks a file written before it: %v", err)
	}

	// A raw-block restore of a filesystem snapshot is refused.
	_, err := src.cc.CreateVolume(src.ctx, &csi.CreateVolumeRequest{Name: "pvc-blk", VolumeCapabilities: []*csi.VolumeCapability{blockRWO},
		Parameters: map[string]string{"clusterID": "dev"}, Secrets: secrets(), VolumeContentSource: snapSrc(snap.SnapshotId)})
	if err == nil || !strings.Contains(err.Error(), "ext4 filesystem") {
		t.Fatalf("block restore of an ext4 snapshot: %v", err)
	}

	// Delete orders: the source while its snapshot lives, then a second
	// restore from that snapshot, then the snapshot while restores
	// live, then the restores and the clone.
	src.unpublish(a)
	src.detach()
	src.delete()
	if out := run(t, "rbd", "ls", "rbd"); strings.Contains(out, imageOf(src.vol.VolumeId)) || !strings.Contains(out, "csi-gone-") {
		t.Fatalf("after deleting the source, the pool holds:\n%s", out)
	}
	r2 := src.another("restored2")
	r2.createFrom("pvc-restored-2", 256<<20, fsCap("ext4", rwo), snapSrc(snap.SnapshotId))
	r2.attach()
	r2a := r2.publish("restored2", true)
	sameFile(t, filepath.Join(r2a, "data"), before, "a restore after the source was deleted")
	_, err = src.cc.DeleteSnapshot(src.ctx, &csi.DeleteSnapshotRequest{SnapshotId: snap.SnapshotId, Secrets: secrets()})
	src.must("DeleteSnapshot", err)
	sameFile(t, filepath.Join(ra, "data"), before, "the restore after its snapshot was deleted")
	for _, v := range []struct {
		r      *volumeRig
		target string
	}{{rs, ra}, {cl, ca}, {r2, r2a}} {
		v.r.unpublish(v.target)
		v.r.detach()
		v.r.delete()
	}
	gone := allGone(t, imagesOf(src.vol.VolumeId, rs.vol.VolumeId, cl.vol.VolumeId, r2.vol.VolumeId), 3*time.Minute)
	t.Logf("pool and trash empty of this test's images %s after the last delete", gone.Round(time.Millisecond))
	noKeyIn(t, src.p)
}

// TestSnapshotTimeVsCephCSI times snapshotting a mounted 1 GiB volume
// and restoring it (CreateVolume from the snapshot, 2 GiB, then
// NodeStage with the filesystem grown), beside the same steps done the
// way ceph-csi does them, in the same run: its snapshot is `snap
// create` on the source, a format-2 clone of it as a hidden image,
// `snap rm` on the source and `snap create` on the clone; its restore a
// clone of that, a resize, and rbd-nbd's map, mount and resize2fs. The
// rbd commands each pay a process start and a cluster connection that
// ceph-csi's long-lived process does not: the log gives one such
// command's time too. Times are for the record, not a verdict.
func TestSnapshotTimeVsCephCSI(t *testing.T) {
	r := newVolumeRig(t)
	if _, err := exec.LookPath("rbd-nbd"); err != nil {
		t.Skip("Ceph's rbd-nbd is not installed")
	}
	r.create("pvc-snaptime", 1<<30, fsCap("ext4", rwo))
	r.attach()
	a := r.publish("snaptime", false)
	randomFile(t, filepath.Join(a, "data"), 64<<20)
	// Written back first: the times compare the snapshot steps, not the
	// flush of 64 MiB the freeze would otherwise do (ceph-csi has no
	// freeze, so its snapshot would not hold them).
	t0 := time.Now()
	run(t, "sync", "-f", filepath.Join(a, "data"))
	flush := time.Since(t0)
	img := imageOf(r.vol.VolumeId)

	t0 = time.Now()
	snap := r.snapshot("snap-time")
	oursSnap := time.Since(t0)
	rs := r.another("snaptime-restored")
	t0 = time.Now()
	rs.createFrom("pvc-snaptime-restored", 2<<30, fsCap("ext4", rwo), snapSrc(snap.SnapshotId))
	oursRestore := time.Since(t0)
	t0 = time.Now()
	rs.attach()
	oursStage := time.Since(t0)

	// ceph-csi's sequence on the same image, still mounted (no freeze:
	// ceph-csi has none).
	t0 = time.Now()
	run(t, "rbd", "info", "rbd/"+img)
	oneCommand := time.Since(t0)
	feats := "layering,deep-flatten"
	t0 = time.Now()
	run(t, "rbd", "snap", "create", "--no-progress", "rbd/"+img+"@csi-snap-c")
	run(t, "rbd", "clone", "--rbd-default-clone-format", "2", "--image-feature", feats, "rbd/"+img+"@csi-snap-c", "rbd/csi-snap-c")
	run(t, "rbd", "snap", "rm", "--no-progress", "rbd/"+img+"@csi-snap-c")
	run(t, "rbd", "snap", "create", "--no-progress", "rbd/csi-snap-c@csi-snap-c")
	cephSnap := time.Since(t0)
	t0 = time.Now()
	run(t, "rbd", "clone", "--rbd-default-clone-format", "2", "--image-feature",
		"layering,exclusive-lock,object-map,fast-diff,deep-flatten", "rbd/csi-snap-c@csi-snap-c", "rbd/csi-vol-c")
	run(t, "rbd", "resize", "--no-progress", "--size", "2G", "rbd/csi-vol-c")
	cephRestore := time.Since(t0)
	keyfile := filepath.Join(r.dir, "key")
	os.WriteFile(keyfile, []byte(cluster.key), 0o600)
	mnt := filepath.Join(r.dir, "cephcsi-restored")
	os.MkdirAll(mnt, 0o750)
	t0 = time.Now()
	dev := strings.TrimSpace(run(t, "rbd-nbd", "--id", "admin", "-m", cluster.mons, "--keyfile="+keyfile,
		"--log-file", filepath.Join(r.dir, "rbd-nbd.log"), "map", "rbd/csi-vol-c", "--try-netlink",
		"--reattach-timeout=300", "--io-timeout=0", "--cookie=csi-vol-c"))
	run(t, "blkid", "-p", "-s", "TYPE", "-o", "export", dev)
	run(t, "mount", "-t", "ext4", "-o", "_netdev", dev, mnt)
	run(t, "resize2fs", dev)
	cephStage := time.Since(t0)
	if total := fsTotal(t, mnt); total < 1800<<20 {
		t.Fatalf("ceph-csi's restore is %d bytes after resize2fs", total)
	}
	ra := rs.publish("snaptime-restored", false)
	if total := fsTotal(t, ra); total < 1800<<20 {
		t.Fatalf("our restore's filesystem is %d bytes: not grown", total)
	}
	ms := func(d time.Duration) time.Duration { return d.Round(time.Millisecond) }
	t.Logf("snapshot of a mounted 1 GiB ext4 volume: rbd-nbd-go CreateSnapshot %s (with fsfreeze); "+
		"ceph-csi's 4 rbd commands %s (one rbd command alone: %s); the 64 MiB written before, synced first: %s",
		ms(oursSnap), ms(cephSnap), ms(oneCommand), ms(flush))
	t.Logf("restore to 2 GiB: rbd-nbd-go CreateVolume %s + NodeStage %s = %s; ceph-csi's clone+resize %s + map, mount, resize2fs %s = %s",
		ms(oursRestore), ms(oursStage), ms(oursRestore+oursStage), ms(cephRestore), ms(cephStage), ms(cephRestore+cephStage))
	run(t, "umount", mnt)
	run(t, "rbd-nbd", "unmap", dev)
	run(t, "rbd", "rm", "--no-progress", "rbd/csi-vol-c")
	run(t, "rbd", "snap", "rm", "--no-progress", "rbd/csi-snap-c@csi-snap-c")
	run(t, "rbd", "rm", "--no-progress", "rbd/csi-snap-c")
	rs.unpublish(ra)
	rs.detach()
	rs.delete()
	r.unpublish(a)
	r.detach()
	_, err := r.cc.DeleteSnapshot(r.ctx, &csi.DeleteSnapshotRequest{SnapshotId: snap.SnapshotId, Secrets: secrets()})
	r.must("DeleteSnapshot", err)
	r.delete()
}
