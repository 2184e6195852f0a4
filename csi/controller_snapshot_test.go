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

func snapSource(id string) *csi.VolumeContentSource {
	return &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
		Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: id}}}
}

func volSourceOf(id string) *csi.VolumeContentSource {
	return &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{
		Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: id}}}
}

func (r *rig) snapshot(t *testing.T, name, source string) *csi.Snapshot {
	t.Helper()
	resp, err := r.d.CreateSnapshot(context.Background(), &csi.CreateSnapshotRequest{Name: name, SourceVolumeId: source,
		Secrets: goodSecrets, Parameters: map[string]string{"clusterID": "c1"}})
	if err != nil {
		t.Fatalf("CreateSnapshot %s: %v", name, err)
	}
	return resp.GetSnapshot()
}

func (r *rig) restore(name string, src *csi.VolumeContentSource, size int64) (*csi.Volume, error) {
	return r.restoreWith(name, src, size, map[string]string{"clusterID": "c1", "pool": "rbd"})
}

func (r *rig) restoreWith(name string, src *csi.VolumeContentSource, size int64, params map[string]string) (*csi.Volume, error) {
	resp, err := r.d.CreateVolume(context.Background(), &csi.CreateVolumeRequest{Name: name,
		CapacityRange:      &csi.CapacityRange{RequiredBytes: size},
		VolumeCapabilities: []*csi.VolumeCapability{mountCap("ext4", rwo)},
		Parameters:         params, Secrets: goodSecrets, VolumeContentSource: src})
	return resp.GetVolume(), err
}

func (r *rig) deleteVolume(t *testing.T, id string) {
	t.Helper()
	if _, err := r.d.DeleteVolume(context.Background(), &csi.DeleteVolumeRequest{VolumeId: id, Secrets: goodSecrets}); err != nil {
		t.Fatalf("DeleteVolume %s: %v", id, err)
	}
}

func (r *rig) deleteSnapshot(t *testing.T, id string) {
	t.Helper()
	if _, err := r.d.DeleteSnapshot(context.Background(), &csi.DeleteSnapshotRequest{SnapshotId: id, Secrets: goodSecrets}); err != nil {
		t.Fatalf("DeleteSnapshot %s: %v", id, err)
	}
}

// imageNames lists the fake pool's images.
func (r *rig) imageNames() []string {
	r.images.mu.Lock()
	defer r.images.mu.Unlock()
	var out []string
	for _, i := range r.images.images {
		out = append(out, i.Spec.Image)
	}
	return out
}

func TestSnapshotNameIdempotency(t *testing.T) {
	r := newRig(t)
	a := r.create(t, "vol-a", 64<<20, nil)
	b := r.create(t, "vol-b", 64<<20, nil)
	s1 := r.snapshot(t, "snap-1", a.VolumeId)
	if !s1.ReadyToUse || s1.SourceVolumeId != a.VolumeId || s1.SizeBytes != 64<<20 || s1.CreationTime == nil {
		t.Fatalf("snapshot %+v", s1)
	}
	if again := r.snapshot(t, "snap-1", a.VolumeId); again.SnapshotId != s1.SnapshotId {
		t.Fatalf("same name, same source: %s, then %s", s1.SnapshotId, again.SnapshotId)
	}
	_, err := r.d.CreateSnapshot(context.Background(), &csi.CreateSnapshotRequest{Name: "snap-1", SourceVolumeId: b.VolumeId,
		Secrets: goodSecrets})
	wantCode(t, "same name, other source", err, codes.AlreadyExists, a.VolumeId)
	r.deleteSnapshot(t, s1.SnapshotId)
	r.deleteSnapshot(t, s1.SnapshotId) // again: success
	if s := r.snapshot(t, "snap-1", b.VolumeId); s.SourceVolumeId != b.VolumeId {
		t.Fatalf("the name after its snapshot was deleted: %+v", s)
	}
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		req  *csi.CreateSnapshotRequest
		code codes.Code
		says string
	}{
		{"no name", &csi.CreateSnapshotRequest{SourceVolumeId: a.VolumeId, Secrets: goodSecrets}, codes.InvalidArgument, "snapshot name"},
		{"no source", &csi.CreateSnapshotRequest{Name: "x", Secrets: goodSecrets}, codes.InvalidArgument, "source volume ID"},
		{"unknown parameter", &csi.CreateSnapshotRequest{Name: "x", SourceVolumeId: a.VolumeId, Secrets: goodSecrets,
			Parameters: map[string]string{"pool": "rbd"}}, codes.InvalidArgument, `"pool"`},
		{"other cluster", &csi.CreateSnapshotRequest{Name: "x", SourceVolumeId: a.VolumeId, Secrets: goodSecrets,
			Parameters: map[string]string{"clusterID": "ns"}}, codes.InvalidArgument, "clusterID"},
		{"bad prefix", &csi.CreateSnapshotRequest{Name: "x", SourceVolumeId: a.VolumeId, Secrets: goodSecrets,
			Parameters: map[string]string{"snapshotNamePrefix": "a/b"}}, codes.InvalidArgument, "snapshotNamePrefix"},
		{"missing source", &csi.CreateSnapshotRequest{Name: "x", SourceVolumeId: "nbd1/c1/rbd//gone", Secrets: goodSecrets},
			codes.NotFound, "gone"},
		{"not our source", &csi.CreateSnapshotRequest{Name: "x", SourceVolumeId: "vol-0001", Secrets: goodSecrets},
			codes.NotFound, "not a volume ID"},
	} {
		_, err := r.d.CreateSnapshot(ctx, tc.req)
		wantCode(t, tc.name, err, tc.code, tc.says)
	}
	// The snapshot name prefix of the class names the RBD snapshot.
	resp, err := r.d.CreateSnapshot(ctx, &csi.CreateSnapshotRequest{Name: "snap-p", SourceVolumeId: a.VolumeId,
		Secrets: goodSecrets, Parameters: map[string]string{"snapshotNamePrefix": "backup-",
			"csi.storage.k8s.io/volumesnapshot/name": "x"}})
	if err != nil {
		t.Fatal(err)
	}
	sid, _ := parseSnapshotID(resp.Snapshot.SnapshotId)
	got, _ := r.images.GetSnapshot(ceph.Options{Key: "AQDkey", MonHost: "m"}, sid.Image, sid.SnapID)
	if !strings.HasPrefix(got.Name, "backup-") {
		t.Fatalf("RBD snapshot %q, want the class's prefix", got.Name)
	}
}

func TestListSnapshotsPagination(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	a := r.create(t, "vol-a", 64<<20, nil)
	b := r.create(t, "vol-b", 64<<20, nil)
	var ids []string
	for i, name := range []string{"s1", "s2", "s3", "s4", "s5"} {
		src := a.VolumeId
		if i >= 3 {
			src = b.VolumeId
		}
		ids = append(ids, r.snapshot(t, name, src).SnapshotId)
	}
	list := func(req *csi.ListSnapshotsRequest) *csi.ListSnapshotsResponse {
		t.Helper()
		req.Secrets = goodSecrets
		resp, err := r.d.ListSnapshots(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
	page := list(&csi.ListSnapshotsRequest{MaxEntries: 2})
	if len(page.Entries) != 2 || page.NextToken == "" {
		t.Fatalf("first page: %d entries, token %q", len(page.Entries), page.NextToken)
	}
	// A snapshot deleted between pages: the next page skips nothing else.
	r.deleteSnapshot(t, page.Entries[0].Snapshot.SnapshotId)
	rest := list(&csi.ListSnapshotsRequest{StartingToken: page.NextToken})
	if len(rest.Entries) != 3 || rest.NextToken != "" {
		t.Fatalf("second page: %d entries, token %q", len(rest.Entries), rest.NextToken)
	}
	seen := map[string]bool{}
	for _, e := range append(page.Entries, rest.Entries...) {
		seen[e.Snapshot.SnapshotId] = true
	}
	if len(seen) != 5 {
		t.Fatalf("pages saw %d distinct snapshots, want 5", len(seen))
	}
	if got := list(&csi.ListSnapshotsRequest{SourceVolumeId: b.VolumeId}); len(got.Entries) != 2 {
		t.Fatalf("by source: %d entries", len(got.Entries))
	}
	if got := list(&csi.ListSnapshotsRequest{SnapshotId: ids[4]}); len(got.Entries) != 1 || got.Entries[0].Snapshot.SourceVolumeId != b.VolumeId {
		t.Fatalf("by ID: %+v", got.Entries)
	}
	for _, req := range []*csi.ListSnapshotsRequest{{SnapshotId: "nope"}, {SnapshotId: "snap1/c1/rbd//id0001/999"},
		{SourceVolumeId: "nbd1/c1/rbd//none"}, {SourceVolumeId: "nope"}} {
		if got := list(req); len(got.Entries) != 0 {
			t.Fatalf("%v: %d entries, want none", req, len(got.Entries))
		}
	}
	_, err := r.d.ListSnapshots(ctx, &csi.ListSnapshotsRequest{StartingToken: "garbage", Secrets: goodSecrets})
	wantCode(t, "bad token", err, codes.Aborted, "token")
	_, err = r.d.GetSnapshot(ctx, &csi.GetSnapshotRequest{SnapshotId: ids[1], Secrets: goodSecrets})
	if err != nil {
		t.Fatal(err)
	}
	_, err = r.d.GetSnapshot(ctx, &csi.GetSnapshotRequest{SnapshotId: "snap1/c1/rbd//id0001/999", Secrets: goodSecrets})
	wantCode(t, "get a missing snapshot", err, codes.NotFound, "does not exist")
	_, err = r.d.GetSnapshot(ctx, &csi.GetSnapshotRequest{})
	wantCode(t, "get without ID", err, codes.InvalidArgument, "snapshot ID")
}

// Every delete order leaves nothing behind: a volume deleted while its
// snapshot lives, a snapshot while its restore lives.
func TestSnapshotDeleteOrders(t *testing.T) {
	r := newRig(t)
	src := r.create(t, "src", 64<<20, nil)
	s := r.snapshot(t, "snap", src.VolumeId)
	r.deleteVolume(t, src.VolumeId)
	names := r.imageNames()
	if len(names) != 1 || !strings.HasPrefix(names[0], gonePrefix) {
		t.Fatalf("after deleting the source: %v, want its kept image", names)
	}
	// The same CSI name is free at once.
	again := r.create(t, "src", 64<<20, nil)
	restored, err := r.restore("restored", snapSource(s.SnapshotId), 128<<20)
	if err != nil {
		t.Fatal(err)
	}
	if restored.CapacityBytes != 128<<20 || restored.ContentSource.GetSnapshot().GetSnapshotId() != s.SnapshotId {
		t.Fatalf("restored %+v", restored)
	}
	if _, err := r.restore("restored", snapSource(s.SnapshotId), 128<<20); err != nil {
		t.Fatalf("retried restore: %v", err)
	}
	other := r.snapshot(t, "snap-2", again.VolumeId)
	_, err = r.restore("restored", snapSource(other.SnapshotId), 128<<20)
	wantCode(t, "restore of the same name from another snapshot", err, codes.AlreadyExists, "made from")
	_, err = r.restore("small", snapSource(s.SnapshotId), 32<<20)
	wantCode(t, "restore smaller than the snapshot", err, codes.OutOfRange, "source")
	r.deleteSnapshot(t, s.SnapshotId)
	if n := len(r.imageNames()); n != 3 {
		t.Fatalf("the kept image went while a restore needs it: %v", r.imageNames())
	}
	r.deleteVolume(t, restored.VolumeId)
	r.deleteSnapshot(t, other.SnapshotId)
	r.deleteVolume(t, again.VolumeId)
	if n := r.imageNames(); len(n) != 0 {
		t.Fatalf("left behind: %v", n)
	}
	j := r.images.snapState().journal
	for k, m := range j {
		if len(m) != 0 {
			t.Fatalf("journal %s left %v", k, m)
		}
	}
}

// A trashed snapshot that outlived its last clone (librbd tries to
// remove it once, and ignores a failure) does not keep a deleted
// volume's image for good: the collect removes it, then the image.
func TestTrashedSnapshotWithoutClonesCollected(t *testing.T) {
	r := newRig(t)
	src := r.create(t, "src", 64<<20, nil)
	s := r.snapshot(t, "snap", src.VolumeId)
	restored, err := r.restore("restored", snapSource(s.SnapshotId), 0)
	if err != nil {
		t.Fatal(err)
	}
	r.deleteVolume(t, src.VolumeId)
	r.deleteSnapshot(t, s.SnapshotId)
	r.images.mu.Lock()
	r.images.snapState().keepTrashed = true
	r.images.mu.Unlock()
	r.deleteVolume(t, restored.VolumeId)
	if n := r.imageNames(); len(n) != 0 {
		t.Fatalf("left behind: %v", n)
	}
}

// A PVC clone, of a mounted volume as of the call: a temporary snapshot
// that goes at once (kept in the trash namespace for the clone).
func TestCloneOfVolume(t *testing.T) {
	r := newRig(t)
	src := r.create(t, "src", 64<<20, nil)
	clone, err := r.restore("clone", volSourceOf(src.VolumeId), 0)
	if err != nil {
		t.Fatal(err)
	}
	if clone.CapacityBytes != 64<<20 || clone.ContentSource.GetVolume().GetVolumeId() != src.VolumeId {
		t.Fatalf("clone %+v", clone)
	}
	snaps, _ := r.images.ListSnapshots(ceph.Options{Key: "AQDkey", MonHost: "m"}, ceph.ImageSpec{Pool: "rbd", Image: imageName("src")})
	if len(snaps) != 1 || !snaps[0].Trash {
		t.Fatalf("source snapshots after the clone: %+v, want one in the trash", snaps)
	}
	// Block from a filesystem volume is refused.
	_, err = r.d.CreateVolume(context.Background(), &csi.CreateVolumeRequest{Name: "blk",
		VolumeCapabilities: []*csi.VolumeCapability{blockCap(rwo)}, Parameters: map[string]string{"clusterID": "c1"},
		Secrets: goodSecrets, VolumeContentSource: volSourceOf(src.VolumeId)})
	wantCode(t, "block clone of a filesystem volume", err, codes.InvalidArgument, "ext4 filesystem")
	r.deleteVolume(t, src.VolumeId)
	r.deleteVolume(t, clone.VolumeId)
	if n := r.imageNames(); len(n) != 0 {
		t.Fatalf("left behind: %v", n)
	}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for i := 0; !cond(); i++ {
		if i > 500 {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (r *rig) depth(t *testing.T, volID string) int {
	t.Helper()
	vol, _ := parseVolumeID(volID)
	o := ceph.Options{Key: "AQDkey", MonHost: "m"}
	info, err := r.images.ImageInfo(o, vol.Spec)
	if err != nil {
		t.Fatal(err)
	}
	chain, err := r.images.ParentChain(o, ceph.ImageRef{Pool: "rbd", ID: info.ID}, 0)
	if err != nil {
		t.Fatal(err)
	}
	return len(chain)
}

// A chain of restores, each from a snapshot of the one before. With
// soft and hard depth 2, a snapshot of a depth-2 volume is not ready
// and a restore of it answers Aborted while the source is flattened,
// however often it is retried, with one flatten; without deep-flatten
// (a flattened image keeps its snapshots' chains) the new volume is
// flattened before it is handed out instead. With soft depth 1 the
// volumes past it are flattened in the background. No volume returned
// is ever past the hard depth.
func TestRestoreChainDepth(t *testing.T) {
	for _, features := range []string{"layering,exclusive-lock,object-map,fast-diff,deep-flatten", "layering,exclusive-lock"} {
		t.Run("hard/"+features, func(t *testing.T) { restoreChain(t, features, 2, true) })
		t.Run("soft/"+features, func(t *testing.T) { restoreChain(t, features, 1, false) })
	}
}

func restoreChain(t *testing.T, features string, soft int, gated bool) {
	r := newRigWith(t, func(c *Config) {
		c.Limits = Limits{SoftDepth: soft, HardDepth: 2, MinSnapshots: 100, MaxSnapshots: 200}
	})
	var gate chan struct{}
	if gated {
		gate = make(chan struct{})
		r.images.snapState().flattenGate = gate
	}
	params := map[string]string{"clusterID": "c1", "pool": "rbd", "imageFeatures": features}
	vols := []*csi.Volume{r.create(t, "v0", 64<<20, params)}
	aborted := 0
	for i := 1; i <= 4; i++ {
		s := r.snapshot(t, "s"+string(rune('0'+i)), vols[i-1].VolumeId)
		var v *csi.Volume
		for try := 0; ; try++ {
			var err error
			v, err = r.restoreWith("v"+string(rune('0'+i)), snapSource(s.SnapshotId), 64<<20, params)
			if err == nil {
				break
			}
			wantCode(t, "restore past the hard depth", err, codes.Aborted, "flattening")
			aborted++
			if try == 3 && gate != nil {
				// Retries find the flatten running and start no other.
				r.images.mu.Lock()
				n := len(r.images.ss.flattens)
				r.images.mu.Unlock()
				if n != 0 {
					t.Fatalf("flattens ran before the gate opened: %d", n)
				}
				close(gate)
				gate = nil
			}
			time.Sleep(20 * time.Millisecond)
		}
		if d := r.depth(t, v.VolumeId); d > 2 {
			t.Fatalf("v%d returned with depth %d, past the hard depth", i, d)
		}
		vols = append(vols, v)
	}
	if gated && aborted == 0 {
		t.Fatal("no restore was ever held back for a flatten")
	}
	if gate != nil {
		close(gate)
	}
	for _, v := range vols {
		waitFor(t, "background flattens", func() bool { return r.depth(t, v.VolumeId) <= soft })
	}
	r.images.mu.Lock()
	seen := map[string]int{}
	for _, id := range r.images.ss.flattens {
		seen[id]++
	}
	r.images.mu.Unlock()
	for id, n := range seen {
		if n > 1 {
			t.Fatalf("image %s flattened %d times", id, n)
		}
	}
}

// Past --minsnapshotsonimage the clones of trashed snapshots are
// flattened; past --maxsnapshotsonimage no snapshot is taken, and once
// the clones are flat the trashed snapshots go and snapshots work again
// (ceph-csi #4069: create, restore, delete the snapshot, over and over).
func TestManySnapshotsKeepWorking(t *testing.T) {
	r := newRigWith(t, func(c *Config) { c.Limits = Limits{SoftDepth: 4, HardDepth: 8, MinSnapshots: 3, MaxSnapshots: 5} })
	src := r.create(t, "src", 64<<20, nil)
	gate := make(chan struct{}) // flattens wait, so the count reaches the limit
	r.images.snapState().flattenGate = gate
	refused := 0
	for i := range 12 {
		name := "s" + string(rune('a'+i))
		var s *csi.Snapshot
		for try := 0; ; try++ {
			resp, err := r.d.CreateSnapshot(context.Background(), &csi.CreateSnapshotRequest{Name: name,
				SourceVolumeId: src.VolumeId, Secrets: goodSecrets})
			if err == nil {
				s = resp.Snapshot
				break
			}
			wantCode(t, "snapshot past the limit", err, codes.ResourceExhausted, "flattening")
			refused++
			if gate != nil {
				close(gate)
				gate = nil
			}
			if try > 100 {
				t.Fatal("snapshots never worked again")
			}
			time.Sleep(10 * time.Millisecond)
		}
		if _, err := r.restore("r"+name, snapSource(s.SnapshotId), 0); err != nil {
			t.Fatal(err)
		}
		r.deleteSnapshot(t, s.SnapshotId)
	}
	snaps, _ := r.images.ListSnapshots(ceph.Options{Key: "AQDkey", MonHost: "m"}, ceph.ImageSpec{Pool: "rbd", Image: imageName("src")})
	if len(snaps) > 5 {
		t.Fatalf("%d snapshots on the source, past the limit", len(snaps))
	}
	if refused == 0 {
		t.Fatal("no snapshot was refused at the limit")
	}
	t.Logf("%d snapshot calls refused while clones were flattened", refused)
}

func TestLimitsDecisions(t *testing.T) {
	l := Limits{SoftDepth: 2, HardDepth: 4, MinSnapshots: 3, MaxSnapshots: 5}
	for parent, want := range map[int]cloneStep{0: cloneNow, 1: cloneNow, 2: cloneThenFlatten, 3: cloneThenFlatten,
		4: flattenParentFirst, 9: flattenParentFirst} {
		if got := l.cloneStep(parent, true); got != want {
			t.Errorf("cloneStep(%d, deep-flatten) = %v, want %v", parent, got, want)
		}
		if want == flattenParentFirst {
			want = flattenCloneFirst
		}
		if got := l.cloneStep(parent, false); got != want {
			t.Errorf("cloneStep(%d, no deep-flatten) = %v, want %v", parent, got, want)
		}
	}
	for _, tc := range []struct {
		total, trashed int
		want           snapStep
	}{
		{0, 0, snapStep{}},
		{2, 2, snapStep{}},
		{3, 0, snapStep{}},
		{3, 1, snapStep{FlattenTrashed: true}},
		{5, 0, snapStep{Refuse: true}},
		{5, 2, snapStep{FlattenTrashed: true, Refuse: true, Wait: true}},
	} {
		if got := l.snapStep(tc.total, tc.trashed); got != tc.want {
			t.Errorf("snapStep(%d, %d) = %+v, want %+v", tc.total, tc.trashed, got, tc.want)
		}
	}
	if err := DefaultLimits().Validate(); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []Limits{{SoftDepth: 4, HardDepth: 15, MinSnapshots: 1, MaxSnapshots: 2},
		{SoftDepth: 5, HardDepth: 4, MinSnapshots: 1, MaxSnapshots: 2}, {SoftDepth: 0, HardDepth: 4, MinSnapshots: 1, MaxSnapshots: 2},
		{SoftDepth: 1, HardDepth: 4, MinSnapshots: 5, MaxSnapshots: 5}, {SoftDepth: 1, HardDepth: 4, MinSnapshots: 1, MaxSnapshots: 1}} {
		if err := bad.Validate(); err == nil {
			t.Errorf("%+v accepted", bad)
		}
	}
}

func TestSnapshotIDs(t *testing.T) {
	s := snapshotID{ClusterID: "c/1", Image: ceph.ImageRef{Pool: "rbd", Namespace: "ns", ID: "10ab"}, SnapID: 42}
	got, err := parseSnapshotID(s.String())
	if err != nil || got != s {
		t.Fatalf("round trip %q: %+v %v", s.String(), got, err)
	}
	for _, bad := range []string{"", "snap1/c/rbd//id", "snap1/c/rbd//id/0", "snap1/c/rbd//id/x", "nbd1/c/rbd//img",
		"snap1//rbd//id/1", "snap1/c///id/1", "snap1/c/rbd///1", "snap1/c/rbd//i%2Fd/1"} {
		if _, err := parseSnapshotID(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}
