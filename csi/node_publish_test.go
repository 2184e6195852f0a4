package csi

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
)

func TestPublishUnpublish(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	v := r.create(t, "pvc-pub", 1<<20, nil)
	staging := filepath.Join(r.dir, "staging")
	os.Mkdir(staging, 0o750)
	c := mountCap("ext4", csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER)
	pub := func(target string, ro bool) error {
		_, err := r.d.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: v.VolumeId, StagingTargetPath: staging,
			TargetPath: target, VolumeCapability: c, Readonly: ro})
		return err
	}
	t1, t2 := filepath.Join(r.dir, "pods", "a", "mount"), filepath.Join(r.dir, "pods", "b", "mount")
	wantCode(t, "publish before stage", pub(t1, false), codes.FailedPrecondition, "not staged")
	if _, err := r.d.NodeStageVolume(ctx, r.stageReq(v, staging, c)); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := pub(t1, false); err != nil {
			t.Fatal(err)
		}
	}
	wantCode(t, "second writer", pub(t2, false), codes.FailedPrecondition, "SINGLE_NODE_SINGLE_WRITER")
	if _, err := os.Stat(t2); !errors.Is(err, os.ErrNotExist) {
		t.Fatal("a refused publish left its target")
	}
	// Unstage while a pod still has it: refused, the device kept.
	_, err := r.d.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.VolumeId, StagingTargetPath: staging})
	wantCode(t, "unstage while published", err, codes.FailedPrecondition, "still published")
	if r.att.mapped() != 1 {
		t.Fatal("unstage of a published volume unmapped it")
	}
	for range 2 {
		if _, err := r.d.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: v.VolumeId, TargetPath: t1}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := os.Stat(t1); !errors.Is(err, os.ErrNotExist) {
		t.Fatal("target left after unpublish")
	}
	// Unstage from a path the volume is not staged at leaves it alone.
	if _, err := r.d.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.VolumeId,
		StagingTargetPath: filepath.Join(r.dir, "elsewhere")}); err != nil || r.att.mapped() != 1 {
		t.Fatalf("unstage elsewhere: %v, %d mapped", err, r.att.mapped())
	}
	if _, err := r.d.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.VolumeId, StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
	// Two pods on one node: SINGLE_NODE_MULTI_WRITER, one read-only.
	c = mountCap("ext4", csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER)
	if _, err := r.d.NodeStageVolume(ctx, r.stageReq(v, staging, c)); err != nil {
		t.Fatal(err)
	}
	if err := pub(t1, false); err != nil {
		t.Fatal(err)
	}
	if err := pub(t2, true); err != nil {
		t.Fatal(err)
	}
	mps, _ := r.mounter.List()
	var ro bool
	for _, mp := range mps {
		if mp.Path == t2 {
			ro = slices.Contains(mp.Opts, "ro") && slices.Contains(mp.Opts, "bind")
		}
	}
	if len(mps) != 3 || !ro {
		t.Fatalf("mounts %+v: want staging and two binds, the second read-only", mps)
	}
	rec, _, _ := r.d.state.load(v.VolumeId)
	if len(rec.Published) != 2 {
		t.Fatalf("record %+v", rec)
	}
}
