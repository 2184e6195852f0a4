package rbdio

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
)

func TestImageManagement(t *testing.T) {
	needCluster(t)
	cl := NewClusters()
	spec := ceph.ImageSpec{Pool: "rbd", Image: fmt.Sprintf("adm%d", os.Getpid())}
	key := "test.name"
	err := cl.CreateImage(opts(), spec, ceph.NewImage{Size: 64 << 20,
		Features: []string{"layering", "exclusive-lock", "object-map", "fast-diff"},
		Meta:     map[string]string{key: "vol-1"}})
	if err != nil {
		t.Fatal(err)
	}
	info, err := cl.ImageInfo(opts(), spec)
	if err != nil || info.Size != 64<<20 || info.Meta[key] != "vol-1" || !info.HasFeature("fast-diff") || info.Watchers != 0 {
		t.Fatalf("info %+v %v", info, err)
	}
	if err := cl.CreateImage(opts(), spec, ceph.NewImage{Size: 1 << 20}); err == nil {
		t.Fatal("created the same image twice")
	}
	if err := cl.ResizeImage(opts(), spec, 128<<20); err != nil {
		t.Fatal(err)
	}
	list, err := cl.ListImages(opts(), ceph.ImageSpec{Pool: "rbd"}, key)
	if err != nil || len(list) != 1 || list[0].Spec != spec || list[0].Size != 128<<20 {
		t.Fatalf("list %+v %v", list, err)
	}
	// Open (as a mapped device would be): watched, so not removed.
	im := open(t, cl, spec, OpenOptions{})
	if err := cl.RemoveImage(opts(), spec); !errors.Is(err, ceph.ErrImageInUse) {
		t.Fatalf("remove of an open image: %v", err)
	}
	im.Close()
	if err := cl.RemoveImage(opts(), spec); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.ImageInfo(opts(), spec); !errors.Is(err, ceph.ErrImageNotFound) {
		t.Fatalf("info of a removed image: %v", err)
	}
	if err := cl.RemoveImage(opts(), spec); !errors.Is(err, ceph.ErrImageNotFound) {
		t.Fatalf("second remove: %v", err)
	}
	if _, err := cl.ImageInfo(opts(), ceph.ImageSpec{Pool: "nopool", Image: "x"}); !errors.Is(err, ceph.ErrPoolNotFound) {
		t.Fatalf("missing pool: %v", err)
	}
	// The dev cluster runs no ceph-mgr, so the monitor has no pool
	// statistics: said, not reported as zero.
	if avail, err := cl.PoolAvailable(opts(), "rbd"); (err == nil) == (avail == 0) ||
		(err != nil && !strings.Contains(err.Error(), "ceph-mgr")) {
		t.Fatalf("pool available %d %v", avail, err)
	}
	if pools, err := cl.ListPools(opts()); err != nil || !slices.Contains(pools, "rbd") {
		t.Fatalf("pools %v %v", pools, err)
	}
	if _, err := cl.PoolAvailable(opts(), "nopool"); !errors.Is(err, ceph.ErrPoolNotFound) {
		t.Fatalf("missing pool: %v", err)
	}
}

func TestUsed(t *testing.T) {
	spec := newImage(t, "64M") // rbd's default features: fast-diff on
	im := open(t, NewClusters(), spec, OpenOptions{})
	if used, err := im.Used(); err != nil || used != 0 {
		t.Fatalf("fresh image: %d %v", used, err)
	}
	buf := make([]byte, 4096)
	buf[0] = 1
	for _, off := range []uint64{0, 8 << 20, 8<<20 + 4096} {
		if err := do(t, im, nbd.OpWrite, 0, off, buf, len(buf)); err != nil {
			t.Fatal(err)
		}
	}
	// Two 4 MiB objects touched.
	if used, err := im.Used(); err != nil || used != 8<<20 {
		t.Fatalf("used %d %v, want 8 MiB", used, err)
	}
}
