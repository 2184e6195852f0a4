package conformance

import (
	"encoding/json"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
)

// TestQoSLiveModify: a raw block volume staged with a write-IOPS limit,
// fio 4k randwrite at queue depth 16 on it, then ControllerModifyVolume
// while it stays mapped: librbd in the node daemon rereads the image's
// metadata on its own refresh, so the new limit holds with no remap or
// remount. Each rate must be within 10 % of its limit. The limits sit
// well below what the TCG VM does unthrottled (about 650 IOPS alone, under
// 200 with two other VMs on the box), so the rate is the limit's.
func TestQoSLiveModify(t *testing.T) {
	r := newVolumeRig(t)
	resp, err := r.cc.CreateVolume(r.ctx, &csi.CreateVolumeRequest{Name: "pvc-qos",
		CapacityRange: &csi.CapacityRange{RequiredBytes: 64 << 20}, VolumeCapabilities: []*csi.VolumeCapability{blockRWO},
		Parameters: map[string]string{"clusterID": "dev", "pool": "rbd", "baseWriteIops": "60"}, Secrets: secrets()})
	r.must("CreateVolume", err)
	r.vol, r.cap = resp.Volume, blockRWO
	r.attach()
	dev := r.publish("a", false)
	before, pid := r.mapped(), r.p.daemonPID()
	rate := func(limit float64) float64 {
		t.Helper()
		iops := fioIOPS(t, dev)
		t.Logf("write-IOPS limit %.0f: fio measured %.1f IOPS (%+.1f %%)", limit, iops, (iops/limit-1)*100)
		if iops < limit*0.9 || iops > limit*1.1 {
			t.Errorf("%.1f IOPS is not within 10 %% of the limit %.0f", iops, limit)
		}
		return iops
	}
	rate(60)
	_, err = r.cc.ControllerModifyVolume(r.ctx, &csi.ControllerModifyVolumeRequest{VolumeId: r.vol.VolumeId,
		MutableParameters: map[string]string{"baseWriteIops": "180"}, Secrets: secrets()})
	r.must("ControllerModifyVolume", err)
	// librbd refreshes the image at its next I/O after the header
	// notification; fio's ramp time covers it.
	rate(180)
	if after := r.mapped(); after != before || r.p.daemonPID() != pid {
		t.Errorf("the volume was remapped: %s (daemon %d) -> %s (daemon %d)", before, pid, after, r.p.daemonPID())
	}
	r.unpublish(dev)
	r.detach()
}

// fioIOPS runs fio 4k randwrite, queue depth 16, for 10 s after a 2 s
// ramp, on a block device and returns its write IOPS.
func fioIOPS(t *testing.T, dev string) float64 {
	t.Helper()
	out, err := exec.Command("fio", "--name=qos", "--filename="+dev, "--ioengine=libaio", "--direct=1",
		"--rw=randwrite", "--bs=4k", "--iodepth=16", "--size=64M", "--time_based", "--ramp_time=2",
		"--runtime=10", "--output-format=json").Output()
	if err != nil {
		t.Fatalf("fio on %s: %v\n%s", filepath.Base(dev), err, out)
	}
	var res struct {
		Jobs []struct {
			Write struct {
				IOPS float64 `json:"iops"`
			} `json:"write"`
		} `json:"jobs"`
	}
	if err := json.Unmarshal(out, &res); err != nil || len(res.Jobs) != 1 {
		t.Fatalf("fio's output (%v):\n%s", err, out)
	}
	return res.Jobs[0].Write.IOPS
}
