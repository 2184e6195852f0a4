package rbdio

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
)

var allFeatures = []string{"layering", "exclusive-lock", "object-map", "fast-diff", "deep-flatten"}

func createImage(t *testing.T, cl *Clusters, name string, size uint64) ceph.ImageSpec {
	t.Helper()
	spec := ceph.ImageSpec{Pool: "rbd", Image: fmt.Sprintf("%s-%d", name, os.Getpid())}
	if err := cl.CreateImage(opts(), spec, ceph.NewImage{Size: size, Features: allFeatures}); err != nil {
		t.Fatal(err)
	}
	return spec
}

func writeAt(t *testing.T, im *Image, off uint64, b []byte) {
	t.Helper()
	if err := do(t, im, nbd.OpWrite, nbd.ReqFUA, off, b, len(b)); err != nil {
		t.Fatal(err)
	}
}

// A snapshot, a larger clone of it that reads the data as of the
// snapshot, the snapshot removed while the clone lives (kept in the
// trash namespace until the clone goes), the parent renamed under the
// clone, the chain walked, and the clone flattened.
func TestSnapshotCloneFlatten(t *testing.T) {
	needCluster(t)
	cl := NewClusters()
	src := createImage(t, cl, "snapsrc", 16<<20)
	im := open(t, cl, src, OpenOptions{})
	before := bytes.Repeat([]byte("before!!"), 512)
	writeAt(t, im, 1<<20, before)

	s, err := cl.CreateSnapshot(opts(), src, "csi-snap-a", ceph.QuiesceRequired)
	if err != nil {
		t.Fatal(err)
	}
	if s.Name != "csi-snap-a" || s.Size != 16<<20 || s.ID == 0 || s.Image.ID == "" || s.Created.IsZero() ||
		time.Since(s.Created) > time.Minute {
		t.Fatalf("snapshot %+v", s)
	}
	again, err := cl.CreateSnapshot(opts(), src, "csi-snap-a", ceph.QuiesceRequired)
	if err != nil || again.ID != s.ID {
		t.Fatalf("retried snapshot: %+v %v, want id %d", again, err, s.ID)
	}
	writeAt(t, im, 1<<20, bytes.Repeat([]byte("after..."), 512))

	child := ceph.ImageSpec{Pool: "rbd", Image: src.Image + "-clone"}
	parent := src
	parent.Snap = s.Name
	err = cl.CloneImage(opts(), parent, child, ceph.NewImage{Size: 32 << 20, Features: allFeatures,
		Meta: map[string]string{"k": "v"}})
	if err != nil {
		t.Fatal(err)
	}
	info, err := cl.ImageInfo(opts(), child)
	if err != nil || info.Size != 32<<20 || info.Meta["k"] != "v" || info.Parent == nil || info.Parent.SnapID != s.ID ||
		info.Parent.Image != src.Image {
		t.Fatalf("clone info %+v parent %+v %v", info, info.Parent, err)
	}
	if got := export(t, child)[1<<20 : 1<<20+len(before)]; !bytes.Equal(got, before) {
		t.Fatalf("the clone reads %q..., not the data at snapshot time", got[:16])
	}
	chain, err := cl.ParentChain(opts(), ceph.ImageRef{Pool: "rbd", ID: info.ID}, 0)
	if err != nil || len(chain) != 1 || chain[0].ImageID != s.Image.ID {
		t.Fatalf("chain %+v %v", chain, err)
	}

	// Removed while the clone lives: it moves to the trash namespace.
	if err := cl.RemoveSnapshot(opts(), s.Image, s.ID); err != nil {
		t.Fatal(err)
	}
	snaps, err := cl.ListSnapshots(opts(), src)
	if err != nil || len(snaps) != 1 || !snaps[0].Trash || snaps[0].ID != s.ID {
		t.Fatalf("snapshots after remove: %+v %v", snaps, err)
	}
	kids, err := cl.Children(opts(), s.Image, s.ID)
	if err != nil || len(kids) != 1 || kids[0].Image != child.Image {
		t.Fatalf("children %+v %v", kids, err)
	}
	if err := cl.RemoveSnapshot(opts(), s.Image, 999999); !errors.Is(err, ceph.ErrSnapshotNotFound) {
		t.Fatalf("remove of a missing snapshot: %v", err)
	}
	im.Close()
	if err := cl.RemoveImage(opts(), src); !errors.Is(err, ceph.ErrHasSnapshots) {
		t.Fatalf("remove of a parent: %v", err)
	}
	// Renamed under the clone: found by ID, with its new name.
	hidden := ceph.ImageSpec{Pool: "rbd", Image: src.Image + "-gone"}
	if err := cl.RenameImage(opts(), src, hidden.Image); err != nil {
		t.Fatal(err)
	}
	if got, err := cl.GetSnapshot(opts(), s.Image, s.ID); err != nil || got.ImageName != hidden.Image || !got.Trash {
		t.Fatalf("snapshot by ID after the rename: %+v %v", got, err)
	}

	var reports int
	err = cl.Flatten(opts(), ceph.ImageRef{Pool: "rbd", ID: info.ID}, false, nil, time.Millisecond,
		func(done, total uint64) { reports++ })
	if err != nil {
		t.Fatal(err)
	}
	if chain, err := cl.ParentChain(opts(), ceph.ImageRef{Pool: "rbd", ID: info.ID}, 0); err != nil || len(chain) != 0 {
		t.Fatalf("chain after flatten: %+v %v", chain, err)
	}
	if got := export(t, child)[1<<20 : 1<<20+len(before)]; !bytes.Equal(got, before) {
		t.Fatalf("the flattened clone reads %q...", got[:16])
	}
	// The last child gone from the trashed snapshot: librbd removes it,
	// and the parent can go.
	if snaps, err := cl.ListSnapshots(opts(), hidden); err != nil || len(snaps) != 0 {
		t.Fatalf("snapshots after the flatten: %+v %v", snaps, err)
	}
	if err := cl.RemoveImage(opts(), hidden); err != nil {
		t.Fatal(err)
	}
	if err := cl.RemoveImage(opts(), child); err != nil {
		t.Fatal(err)
	}
	if err := cl.Flatten(opts(), ceph.ImageRef{Pool: "rbd", ID: info.ID}, false, nil, time.Second, nil); !errors.Is(err, ceph.ErrImageNotFound) {
		t.Fatalf("flatten of a removed image: %v", err)
	}
	t.Logf("flatten reported progress %d times", reports)
}

// A snapshot of an image another client holds with the exclusive lock
// and a quiesce watch, as a node daemon maps a volume: librbd runs it
// through the lock owner, which quiesces; a failed quiesce fails it
// unless asked to ignore that. A flatten is run by the lock owner too.
func TestSnapshotOfMappedImage(t *testing.T) {
	needCluster(t)
	cl := NewClusters()
	src := createImage(t, cl, "mapped", 8<<20)
	h := &quiesceRecorder{}
	owner := NewClusters() // another client, as the node daemon is
	open(t, owner, src, OpenOptions{Exclusive: true, OnQuiesce: h.hook})
	s, err := cl.CreateSnapshot(opts(), src, "q1", ceph.QuiesceRequired)
	if err != nil {
		t.Fatal(err)
	}
	if calls := h.calls(); len(calls) != 2 || !calls[0] || calls[1] {
		t.Fatalf("quiesce hook calls %v, want [true false]", calls)
	}
	h.failNext()
	if _, err := cl.CreateSnapshot(opts(), src, "q2", ceph.QuiesceRequired); err == nil {
		t.Fatal("snapshot taken although the quiesce hook failed")
	}
	if _, err := cl.CreateSnapshot(opts(), src, "q3", ceph.QuiesceBestEffort); err != nil {
		t.Fatalf("best-effort snapshot: %v", err)
	}
	// A clone of it, flattened while its own exclusive lock is held.
	child := ceph.ImageSpec{Pool: "rbd", Image: src.Image + "-c"}
	parent := src
	parent.Snap = s.Name
	if err := cl.CloneImage(opts(), parent, child, ceph.NewImage{Features: allFeatures}); err != nil {
		t.Fatal(err)
	}
	open(t, owner, child, OpenOptions{Exclusive: true})
	info, err := cl.ImageInfo(opts(), child)
	if err != nil {
		t.Fatal(err)
	}
	// Resumed: the object map is reset first, through the lock owner,
	// and rebuilt once the image is flat.
	if err := cl.Flatten(opts(), ceph.ImageRef{Pool: "rbd", ID: info.ID}, true, nil, time.Second, nil); err != nil {
		t.Fatalf("flatten of an image locked by another client: %v", err)
	}
	if out, err := cluster.Rbd("info", child.String()); err != nil || strings.Contains(out, "invalid") {
		t.Fatalf("after a resumed flatten: %v\n%s", err, out)
	}
	if info, err := cl.ImageInfo(opts(), child); err != nil || info.Parent != nil {
		t.Fatalf("after flatten: parent %+v %v", info.Parent, err)
	}
}

func TestJournal(t *testing.T) {
	needCluster(t)
	cl := NewClusters()
	pool := ceph.ImageSpec{Pool: "rbd"}
	oid := fmt.Sprintf("journal-%d", os.Getpid())
	if got, err := cl.ReadJournal(opts(), pool, oid, []string{"a"}); err != nil || len(got) != 0 {
		t.Fatalf("missing object: %v %v", got, err)
	}
	set := map[string]string{"snap/a": "1", "snap/b": "2", "gone/x": "3"}
	for i := range 700 { // more than one page
		set[fmt.Sprintf("snap/p%04d", i)] = "p"
	}
	if err := cl.UpdateJournal(opts(), pool, oid, set, nil); err != nil {
		t.Fatal(err)
	}
	if got, err := cl.ReadJournal(opts(), pool, oid, []string{"snap/a", "nope"}); err != nil || len(got) != 1 || got["snap/a"] != "1" {
		t.Fatalf("read: %v %v", got, err)
	}
	if got, err := cl.ListJournal(opts(), pool, oid, "snap/"); err != nil || len(got) != 702 {
		t.Fatalf("list: %d %v", len(got), err)
	}
	if err := cl.UpdateJournal(opts(), pool, oid, map[string]string{"snap/c": "4"}, []string{"snap/a", "gone/x"}); err != nil {
		t.Fatal(err)
	}
	if got, err := cl.ListJournal(opts(), pool, oid, "gone/"); err != nil || len(got) != 0 {
		t.Fatalf("after remove: %v %v", got, err)
	}
	if got, err := cl.ReadJournal(opts(), pool, oid, []string{"snap/a", "snap/c"}); err != nil || len(got) != 1 || got["snap/c"] != "4" {
		t.Fatalf("after update: %v %v", got, err)
	}
}
