package csi

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/rbd-nbd-go/rbd-nbd-go/control"
)

func TestStatsExpandHealth(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	v := r.create(t, "pvc-st", 1<<20, nil)
	staging := filepath.Join(r.dir, "staging")
	os.Mkdir(staging, 0o750)
	if _, err := r.d.NodeStageVolume(ctx, r.stageReq(v, staging, mountCap("ext4", rwo))); err != nil {
		t.Fatal(err)
	}
	st, err := r.d.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: v.VolumeId, VolumePath: staging})
	if err != nil || len(st.Usage) != 2 || st.Usage[0].Total <= 0 || st.Usage[1].Unit != csi.VolumeUsage_INODES {
		t.Fatalf("fs stats %+v %v", st, err)
	}
	// The fake device is 1 GiB (sysfs); asking for 2 GiB waits, then
	// gives up.
	_, err = r.d.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: v.VolumeId, VolumePath: staging,
		CapacityRange: &csi.CapacityRange{RequiredBytes: 2 << 30}})
	wantCode(t, "device never grew", err, codes.DeadlineExceeded)
	// NodeStage already ran resize2fs once (a restore may be larger
	// than its filesystem); the expand runs it again.
	staged := len(r.exec.ran("resize2fs"))
	resp, err := r.d.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: v.VolumeId, VolumePath: staging,
		CapacityRange: &csi.CapacityRange{RequiredBytes: 1 << 30}})
	if err != nil || resp.CapacityBytes != 1<<30 || staged != 1 || len(r.exec.ran("resize2fs")) != 2 {
		t.Fatalf("expand %+v %v, resize2fs %v", resp, err, r.exec.ran("resize2fs"))
	}
	h, err := r.d.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: v.VolumeId})
	if err != nil || len(h.VolumeHealth.HealthStatuses) != 0 || h.VolumeHealth.VolumeId != v.VolumeId {
		t.Fatalf("healthy volume: %+v %v", h, err)
	}
	// The daemon loses the device; the mount goes.
	r.att.mu.Lock()
	r.att.devs = map[int]control.Record{}
	r.att.mu.Unlock()
	r.mounter.Unmount(staging)
	h, _ = r.d.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: v.VolumeId})
	var reasons []string
	for _, e := range h.GetVolumeHealth().GetHealthStatuses() {
		if e.Status != csi.VolumeHealthErrorType_INACCESSIBLE {
			t.Errorf("status %v", e.Status)
		}
		reasons = append(reasons, e.Reason)
	}
	if !slices.Equal(reasons, []string{"DeviceLost", "NotMounted"}) {
		t.Fatalf("reasons %v", reasons)
	}
}
