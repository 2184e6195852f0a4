package csi

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
)

// Retries and interrupted calls: what the sidecars do after a lost reply
// or a timeout, and what a controller killed between two steps leaves.

var fakeOpts = ceph.Options{Key: "AQDkey", MonHost: "m"}

func TestDeleteSnapshotTwiceWhileRestoresLive(t *testing.T) {
	r := newRig(t)
	src := r.create(t, "src", 64<<20, nil)
	s := r.snapshot(t, "snap", src.VolumeId)
	if _, err := r.restore("restored", snapSource(s.SnapshotId), 0); err != nil {
		t.Fatal(err)
	}
	r.deleteSnapshot(t, s.SnapshotId)
	// The snapshot is in the trash namespace now; librbd would answer
	// EBUSY to another remove. A retried DeleteSnapshot must succeed.
	r.deleteSnapshot(t, s.SnapshotId)
	_, err := r.d.GetSnapshot(context.Background(), &csi.GetSnapshotRequest{SnapshotId: s.SnapshotId, Secrets: goodSecrets})
	wantCode(t, "get a deleted snapshot", err, codes.NotFound, "does not exist")
}

func TestRetriesAfterTheSourceIsGone(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	src := r.create(t, "src", 64<<20, nil)
	s := r.snapshot(t, "snap", src.VolumeId)
	v, err := r.restore("restored", snapSource(s.SnapshotId), 0)
	if err != nil {
		t.Fatal(err)
	}
	r.deleteVolume(t, src.VolumeId)
	// CreateSnapshot's reply was lost; the source is deleted since.
	again := r.snapshot(t, "snap", src.VolumeId)
	if again.SnapshotId != s.SnapshotId {
		t.Fatalf("a retried CreateSnapshot after its source went: %s, want %s", again.SnapshotId, s.SnapshotId)
	}
	r.deleteSnapshot(t, s.SnapshotId)
	// CreateVolume's reply was lost; its snapshot is deleted since.
	if got, err := r.restore("restored", snapSource(s.SnapshotId), 0); err != nil || got.VolumeId != v.VolumeId {
		t.Fatalf("a retried restore after its snapshot went: %v %v", got, err)
	}
	// A kept image is no volume to list.
	list, err := r.d.ListVolumes(ctx, &csi.ListVolumesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range list.Entries {
		if strings.Contains(e.Volume.VolumeId, gonePrefix) {
			t.Fatalf("ListVolumes lists a deleted volume's image: %s", e.Volume.VolumeId)
		}
	}
	r.deleteVolume(t, v.VolumeId)
	if n := r.imageNames(); len(n) != 0 {
		t.Fatalf("left behind: %v", n)
	}
}

// A clone the first CreateVolume made but did not finish (killed
// before its metadata): the retry finishes it instead of refusing it
// as someone else's image.
func TestHalfMadeCloneIsFinished(t *testing.T) {
	r := newRig(t)
	src := r.create(t, "src", 64<<20, nil)
	s := r.snapshot(t, "snap", src.VolumeId)
	sid, _ := parseSnapshotID(s.SnapshotId)
	snap, _ := r.images.GetSnapshot(fakeOpts, sid.Image, sid.SnapID)
	child := ceph.ImageSpec{Pool: "rbd", Image: imageName("restored")}
	parent := ceph.ImageSpec{Pool: "rbd", Image: snap.ImageName, Snap: snap.Name}
	if err := r.images.CloneImage(fakeOpts, parent, child, ceph.NewImage{Features: defaultFeatures()}); err != nil {
		t.Fatal(err)
	}
	v, err := r.restore("restored", snapSource(s.SnapshotId), 128<<20)
	if err != nil {
		t.Fatalf("the retry of a half-made restore: %v", err)
	}
	info, _ := r.images.ImageInfo(fakeOpts, child)
	if v.CapacityBytes != 128<<20 || info.Size != 128<<20 || info.Meta[metaName] != "restored" || info.Meta[metaSource] != s.SnapshotId {
		t.Fatalf("finished clone: %+v, image %+v", v, info)
	}
	// An image at the name that is not what the call would make stays
	// someone else's.
	if err := r.images.CreateImage(fakeOpts, ceph.ImageSpec{Pool: "rbd", Image: imageName("other")},
		ceph.NewImage{Size: 1 << 20}); err != nil {
		t.Fatal(err)
	}
	_, err = r.restore("other", snapSource(s.SnapshotId), 0)
	wantCode(t, "a foreign image at the name", err, codes.AlreadyExists, "is not volume")
}

// A clone whose image librbd made but never gave its parent (the
// controller killed in between, or librbd's own clean-up of a failed
// clone timed out) is removed and made again, since the clone journal
// says it was ours; the same image without that entry stays someone
// else's. The entry is gone once the clone is finished.
func TestUnfinishedCloneIsMadeAgain(t *testing.T) {
	r := newRig(t)
	src := r.create(t, "src", 64<<20, nil)
	child := ceph.ImageSpec{Pool: "rbd", Image: imageName("clone")}
	husk := func() {
		t.Helper()
		if err := r.images.CreateImage(fakeOpts, child, ceph.NewImage{Size: 64 << 20, Features: defaultFeatures()}); err != nil {
			t.Fatal(err)
		}
	}
	j := r.d.journal(fakeOpts, "rbd", "")
	husk()
	_, err := r.restore("clone", volSourceOf(src.VolumeId), 0)
	wantCode(t, "an image with no parent and no clone journal entry", err, codes.AlreadyExists, "is not volume")

	if err := j.update(map[string]any{cloneKey("clone"): cloneRecord{Image: child.Image, Parent: "rbd/src@x"}}); err != nil {
		t.Fatal(err)
	}
	v, err := r.restore("clone", volSourceOf(src.VolumeId), 0)
	if err != nil {
		t.Fatalf("the retry of a clone left without its parent: %v", err)
	}
	info, _ := r.images.ImageInfo(fakeOpts, child)
	if info.Parent == nil || info.Meta[metaName] != "clone" || v.VolumeId == "" {
		t.Fatalf("the clone made again: parent %v, metadata %v", info.Parent, info.Meta)
	}
	if ok, err := j.get(cloneKey("clone"), nil); ok || err != nil {
		t.Fatalf("the clone journal entry outlived the finished clone (%v)", err)
	}
	if again, err := r.restore("clone", volSourceOf(src.VolumeId), 0); err != nil || again.VolumeId != v.VolumeId {
		t.Fatalf("a retry after the clone was finished: %v %v", again, err)
	}
	// Its maker died between finishing it and dropping the entry: the
	// retry that finds it finished drops it.
	j.update(map[string]any{cloneKey("clone"): cloneRecord{Image: child.Image}})
	if _, err := r.restore("clone", volSourceOf(src.VolumeId), 0); err != nil {
		t.Fatal(err)
	}
	if ok, _ := j.get(cloneKey("clone"), nil); ok {
		t.Fatal("a retry of a finished clone left its journal entry")
	}

	// Open somewhere (a clone still under way elsewhere): not removed.
	husk2 := ceph.ImageSpec{Pool: "rbd", Image: imageName("busy")}
	if err := r.images.CreateImage(fakeOpts, husk2, ceph.NewImage{Size: 64 << 20}); err != nil {
		t.Fatal(err)
	}
	r.images.mu.Lock()
	i := r.images.images[husk2.String()]
	i.Watchers = 1
	r.images.images[husk2.String()] = i
	r.images.mu.Unlock()
	j.update(map[string]any{cloneKey("busy"): cloneRecord{Image: husk2.Image}})
	_, err = r.restore("busy", volSourceOf(src.VolumeId), 0)
	wantCode(t, "an unfinished clone open elsewhere", err, codes.Aborted, "may still be under way")

	// Begun a moment ago (by another controller, perhaps): not removed.
	husk3 := ceph.ImageSpec{Pool: "rbd", Image: imageName("young")}
	if err := r.images.CreateImage(fakeOpts, husk3, ceph.NewImage{Size: 64 << 20}); err != nil {
		t.Fatal(err)
	}
	j.update(map[string]any{cloneKey("young"): cloneRecord{Image: husk3.Image, Since: time.Now()}})
	_, err = r.restore("young", volSourceOf(src.VolumeId), 0)
	wantCode(t, "an unfinished clone begun a moment ago", err, codes.Aborted, "may still be under way")
	if _, err := r.images.ImageInfo(fakeOpts, husk3); err != nil {
		t.Fatalf("a young unfinished clone was removed: %v", err)
	}
}

// A clone's temporary snapshot left on its source by a failed clone
// does not keep the source's image once it is deleted.
func TestOrphanedSnapshotsDoNotKeepImages(t *testing.T) {
	r := newRig(t)
	src := r.create(t, "src", 64<<20, nil)
	spec := ceph.ImageSpec{Pool: "rbd", Image: imageName("src")}
	if _, err := r.images.CreateSnapshot(fakeOpts, spec, hashName(cloneSnapPrefix, "failed-clone"), ceph.QuiesceRequired); err != nil {
		t.Fatal(err)
	}
	// And one a CreateSnapshot took but never journalled.
	if _, err := r.images.CreateSnapshot(fakeOpts, spec, hashName(defaultSnapPrefix, "lost"), ceph.QuiesceRequired); err != nil {
		t.Fatal(err)
	}
	// An admin's own snapshot keeps it, as it should.
	r.deleteVolume(t, src.VolumeId)
	if n := r.imageNames(); len(n) != 0 {
		t.Fatalf("orphaned snapshots kept the image: %v", n)
	}
}

func TestListedReadiness(t *testing.T) {
	r := newRigWith(t, func(c *Config) { c.Limits = Limits{SoftDepth: 2, HardDepth: 2, MinSnapshots: 100, MaxSnapshots: 200} })
	gate := make(chan struct{})
	r.images.snapState().flattenGate = gate
	v0 := r.create(t, "v0", 64<<20, nil)
	s1 := r.snapshot(t, "s1", v0.VolumeId)
	v1, _ := r.restore("v1", snapSource(s1.SnapshotId), 0)
	s2 := r.snapshot(t, "s2", v1.VolumeId)
	v2, _ := r.restore("v2", snapSource(s2.SnapshotId), 0)
	s3 := r.snapshot(t, "s3", v2.VolumeId) // depth 2: not ready, v2 flattening
	if s3.ReadyToUse {
		t.Fatal("a snapshot with no room for a restore is ready")
	}
	list := func() map[string]bool {
		resp, err := r.d.ListSnapshots(context.Background(), &csi.ListSnapshotsRequest{Secrets: goodSecrets})
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]bool{}
		for _, e := range resp.Entries {
			out[e.Snapshot.SnapshotId] = e.Snapshot.ReadyToUse
		}
		return out
	}
	if got := list(); got[s3.SnapshotId] || !got[s1.SnapshotId] {
		t.Fatalf("listed readiness while v2 flattens: %v", got)
	}
	close(gate)
	waitFor(t, "the flatten", func() bool { return r.depth(t, v2.VolumeId) == 0 })
	// The snapshotter asks again (CreateSnapshot) until it is ready.
	if again := r.snapshot(t, "s3", v2.VolumeId); !again.ReadyToUse {
		t.Fatal("not ready after the flatten")
	}
	if got := list(); !got[s3.SnapshotId] {
		t.Fatalf("listed readiness after the flatten: %v", got)
	}
}
