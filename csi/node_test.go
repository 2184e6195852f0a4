package csi

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
	"github.com/rbd-nbd-go/rbd-nbd-go/control"
)

func (r *rig) stageReq(v *csi.Volume, staging string, c *csi.VolumeCapability) *csi.NodeStageVolumeRequest {
	return &csi.NodeStageVolumeRequest{VolumeId: v.VolumeId, StagingTargetPath: staging, VolumeCapability: c,
		Secrets: goodSecrets, VolumeContext: v.VolumeContext}
}

// nothingLeft fails if a volume left any trace on the node.
func (r *rig) nothingLeft(t *testing.T, what, volID, staging string) {
	t.Helper()
	if n := r.att.mapped(); n != 0 {
		t.Errorf("%s: %d device(s) left mapped", what, n)
	}
	if mps, _ := r.mounter.List(); len(mps) != 0 {
		t.Errorf("%s: mounts left: %v", what, mps)
	}
	if _, ok, _ := r.d.state.load(volID); ok {
		t.Errorf("%s: stage record left", what)
	}
	if ents, _ := os.ReadDir(staging); len(ents) != 0 {
		t.Errorf("%s: staging path holds %v", what, ents)
	}
}

func TestStageUnstageFilesystem(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	v := r.create(t, "pvc-s", 1<<20, map[string]string{"clusterID": "c1", "mapOptions": "nbd:connections=3,io-timeout=7"})
	staging := filepath.Join(r.dir, "staging")
	os.Mkdir(staging, 0o750)
	req := r.stageReq(v, staging, mountCap("xfs", rwo))
	for range 3 { // repeats are no-ops
		if _, err := r.d.NodeStageVolume(ctx, req); err != nil {
			t.Fatal(err)
		}
	}
	if len(r.att.maps) != 1 || len(r.exec.ran("mkfs")) != 1 {
		t.Fatalf("maps %d, mkfs %v: a repeat did the work again", len(r.att.maps), r.exec.ran("mkfs"))
	}
	m := r.att.maps[0]
	want := control.Record{Index: control.AnyIndex, Spec: "rbd/" + imageName("pvc-s"), Cookie: v.VolumeId,
		MapOptions: control.MapOptions{Exclusive: true, Connections: 3, IOTimeout: 7 * time.Second,
			ReattachTimeout: 300 * time.Second, MaxSectorsKB: 4096, Quiesce: true},
		Ceph: ceph.Options{MonHost: "127.0.0.1:6789", ID: "csi", Key: "AQDkey", OpTimeout: 30 * time.Second}}
	want.Index = m.Index
	if m != want {
		t.Fatalf("map record\n got %+v\nwant %+v", m, want)
	}
	if mkfs := r.exec.ran("mkfs")[0]; !slices.Equal(mkfs, []string{"mkfs.xfs", "-K", "-f", "/dev/nbd0"}) {
		t.Fatalf("mkfs %v", mkfs)
	}
	mps, _ := r.mounter.List()
	if len(mps) != 1 || mps[0].Path != staging || mps[0].Type != "xfs" || !slices.Contains(mps[0].Opts, "nouuid") {
		t.Fatalf("mounts %+v", mps)
	}
	// Another staging path for the same volume is refused.
	other := filepath.Join(r.dir, "other")
	_, err := r.d.NodeStageVolume(ctx, r.stageReq(v, other, mountCap("xfs", rwo)))
	wantCode(t, "stage elsewhere", err, codes.FailedPrecondition)
	for range 2 {
		if _, err := r.d.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.VolumeId, StagingTargetPath: staging}); err != nil {
			t.Fatal(err)
		}
	}
	r.nothingLeft(t, "unstaged", v.VolumeId, staging)
	// Staged again (after a reschedule): the filesystem is found, not
	// made again.
	if _, err := r.d.NodeStageVolume(ctx, req); err != nil {
		t.Fatal(err)
	}
	if n := len(r.exec.ran("mkfs")); n != 1 {
		t.Fatalf("formatted %d times", n)
	}
}

func TestStageRollsBackEveryStep(t *testing.T) {
	for _, step := range []string{"map", "late map", "target", "mkfs", "mount", "bind"} {
		t.Run(step, func(t *testing.T) {
			r := newRig(t)
			ctx := context.Background()
			v := r.create(t, "pvc-f", 1<<20, nil)
			staging := filepath.Join(r.dir, "staging")
			os.Mkdir(staging, 0o750)
			c := mountCap("ext4", rwo)
			want := codes.Internal
			switch step {
			case "map":
				r.att.mapErr = errors.Join(errors.New("image rbd/x does not exist"), ceph.ErrImageNotFound)
				want = codes.NotFound
			case "late map":
				// The daemon mapped, but the call's deadline passed first:
				// the device must still be unmapped, and the code is not
				// final.
				r.att.lateErr = fmt.Errorf("control socket: %w", context.DeadlineExceeded)
				want = codes.DeadlineExceeded
			case "target":
				// A block stage whose file cannot be created.
				c = blockCap(rwo)
				os.Chmod(staging, 0o500)
				if os.Geteuid() == 0 {
					os.Remove(staging)
					os.WriteFile(staging, nil, 0o600) // a file where a directory must be
				}
			case "mkfs":
				r.exec.mkfsErr = errors.New("exit status 1")
			case "mount":
				r.mounter.mountErr = errors.New("mount: wrong fs type")
			case "bind":
				c = blockCap(rwo)
				r.mounter.mountErr = errors.New("mount: permission denied")
			}
			_, err := r.d.NodeStageVolume(ctx, r.stageReq(v, staging, c))
			wantCode(t, step, err, want)
			if step == "target" {
				os.Remove(staging)
				os.Mkdir(staging, 0o750)
			}
			r.nothingLeft(t, step, v.VolumeId, staging)
		})
	}
}

func TestBlockVolume(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	v := r.create(t, "pvc-b", 1<<20, nil)
	staging := filepath.Join(r.dir, "staging")
	os.Mkdir(staging, 0o750)
	c := blockCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)
	if _, err := r.d.NodeStageVolume(ctx, r.stageReq(v, staging, c)); err != nil {
		t.Fatal(err)
	}
	if m := r.att.maps[0]; m.Exclusive || m.ReadOnly {
		t.Fatalf("shared block must map without the lock: %+v", m)
	}
	if len(r.exec.ran("mkfs")) != 0 {
		t.Fatal("a block volume was formatted")
	}
	target := filepath.Join(r.dir, "pods", "a", "dev")
	_, err := r.d.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: v.VolumeId, StagingTargetPath: staging,
		TargetPath: target, VolumeCapability: c})
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(target); err != nil || fi.IsDir() {
		t.Fatalf("block target must be a file: %v %v", fi, err)
	}
	_, err = r.d.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: v.VolumeId, StagingTargetPath: staging,
		TargetPath: filepath.Join(r.dir, "x"), VolumeCapability: mountCap("ext4", rwo)})
	wantCode(t, "mount of a block stage", err, codes.InvalidArgument)
	r.d.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: v.VolumeId, TargetPath: target})
	if _, err := r.d.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.VolumeId, StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
	r.nothingLeft(t, "block unstaged", v.VolumeId, staging)
}

func TestUnstageBusyKeepsRecord(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	v := r.create(t, "pvc-busy", 1<<20, nil)
	staging := filepath.Join(r.dir, "staging")
	os.Mkdir(staging, 0o750)
	if _, err := r.d.NodeStageVolume(ctx, r.stageReq(v, staging, mountCap("ext4", rwo))); err != nil {
		t.Fatal(err)
	}
	r.att.busy = true
	_, err := r.d.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.VolumeId, StagingTargetPath: staging})
	wantCode(t, "busy device", err, codes.FailedPrecondition, "in use")
	if _, ok, _ := r.d.state.load(v.VolumeId); !ok || r.att.mapped() != 1 {
		t.Fatal("a failed unstage forgot the volume")
	}
	r.att.busy = false
	if _, err := r.d.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.VolumeId, StagingTargetPath: staging}); err != nil {
		t.Fatal(err)
	}
	r.nothingLeft(t, "retried unstage", v.VolumeId, staging)
}

func TestNodeValidationAndLocks(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	c := mountCap("ext4", rwo)
	for _, tc := range []struct {
		name string
		call func() error
		code codes.Code
	}{
		{"stage: no id", func() error {
			_, err := r.d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{StagingTargetPath: "/s", VolumeCapability: c})
			return err
		}, codes.InvalidArgument},
		{"stage: no path", func() error {
			_, err := r.d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "v", VolumeCapability: c})
			return err
		}, codes.InvalidArgument},
		{"stage: no capability", func() error {
			_, err := r.d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: "/s"})
			return err
		}, codes.InvalidArgument},
		{"stage: bad fstype", func() error {
			_, err := r.d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: "/s",
				VolumeCapability: mountCap("btrfs", rwo)})
			return err
		}, codes.InvalidArgument},
		{"stage: unknown volume", func() error {
			_, err := r.d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "fake", StagingTargetPath: "/s",
				VolumeCapability: c, Secrets: goodSecrets})
			return err
		}, codes.NotFound},
		{"stage: no secrets", func() error {
			_, err := r.d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "nbd1/c1/rbd//x", StagingTargetPath: "/s",
				VolumeCapability: c})
			return err
		}, codes.InvalidArgument},
		{"stage: unknown cluster", func() error {
			_, err := r.d.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "nbd1/zz/rbd//x", StagingTargetPath: "/s",
				VolumeCapability: c, Secrets: goodSecrets})
			return err
		}, codes.InvalidArgument},
		{"unstage: no path", func() error {
			_, err := r.d.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "v"})
			return err
		}, codes.InvalidArgument},
		{"publish: no target", func() error {
			_, err := r.d.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: "v", StagingTargetPath: "/s", VolumeCapability: c})
			return err
		}, codes.InvalidArgument},
		{"unpublish: no target", func() error {
			_, err := r.d.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: "v"})
			return err
		}, codes.InvalidArgument},
		{"stats: missing path", func() error {
			_, err := r.d.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: "v", VolumePath: "/nonexistent/x"})
			return err
		}, codes.NotFound},
		{"expand: missing path", func() error {
			_, err := r.d.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: "v", VolumePath: "/nonexistent/x"})
			return err
		}, codes.NotFound},
		{"health: not staged", func() error {
			_, err := r.d.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: "v"})
			return err
		}, codes.NotFound},
	} {
		wantCode(t, tc.name, tc.call(), tc.code)
	}
	// A second call for a volume in flight is Aborted at once.
	v := r.create(t, "pvc-l", 1<<20, nil)
	staging := filepath.Join(r.dir, "staging")
	os.Mkdir(staging, 0o750)
	r.att.blockOn, r.att.inMap = make(chan struct{}), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, err := r.d.NodeStageVolume(ctx, r.stageReq(v, staging, c))
		done <- err
	}()
	<-r.att.inMap // the stage holds the volume's lock, waiting in the map
	_, err := r.d.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.VolumeId, StagingTargetPath: staging})
	wantCode(t, "unstage while staging", err, codes.Aborted)
	close(r.att.blockOn)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}
