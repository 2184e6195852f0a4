package conformance

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
)

// TestStageTimeVsCephCSI measures NodeStage and NodeUnstage against the
// commands ceph-csi's nbd mounter runs for the same steps, with Ceph's
// own rbd-nbd (internal/rbd/rbd_attach.go: map with its flags, blkid,
// mkfs.ext4 with its options, mount; umount, unmap). It logs the times;
// it asserts only that both paths work (times are for the record, not a
// test's verdict).
func TestStageTimeVsCephCSI(t *testing.T) {
	r := newVolumeRig(t)
	if _, err := exec.LookPath("rbd-nbd"); err != nil {
		t.Skip("Ceph's rbd-nbd is not installed")
	}
	keyfile := filepath.Join(r.dir, "key")
	os.WriteFile(keyfile, []byte(cluster.key), 0o600)
	mnt := filepath.Join(r.dir, "cephcsi-mnt")
	os.MkdirAll(mnt, 0o750)
	cephCSI := func(image string) (stage, unstage time.Duration) {
		t0 := time.Now()
		dev := strings.TrimSpace(run(t, "rbd-nbd", "--id", "admin", "-m", cluster.mons, "--keyfile="+keyfile,
			"--log-file", filepath.Join(r.dir, "rbd-nbd.log"), "map", "rbd/"+image, "--try-netlink",
			"--reattach-timeout=300", "--io-timeout=0", "--cookie="+image))
		if out, err := exec.Command("blkid", "-p", "-s", "TYPE", "-s", "PTTYPE", "-o", "export", dev).CombinedOutput(); err != nil {
			run(t, "mkfs.ext4", "-m0", "-Enodiscard,lazy_itable_init=1,lazy_journal_init=1", "-F", dev)
		} else if !strings.Contains(string(out), "ext4") {
			t.Fatalf("blkid: %s", out)
		}
		run(t, "mount", "-t", "ext4", "-o", "_netdev", dev, mnt)
		stage = time.Since(t0)
		t0 = time.Now()
		run(t, "umount", mnt)
		run(t, "rbd-nbd", "unmap", dev)
		return stage, time.Since(t0)
	}
	ours := func() (stage, unstage time.Duration) {
		t0 := time.Now()
		r.attach()
		stage = time.Since(t0)
		t0 = time.Now()
		r.detach()
		return stage, time.Since(t0)
	}
	// First stage (mkfs) on twin fresh images, then a second stage of
	// the same formatted image by each.
	run(t, "rbd", "create", "--size", "1G", "rbd/cephcsi-twin")
	s1, u1 := cephCSI("cephcsi-twin")
	r.create("pvc-timing", 1<<30, fsCap("ext4", rwo))
	s2, u2 := ours()
	s3, u3 := cephCSI(r.vol.VolumeContext["imageName"])
	s4, u4 := ours()
	t.Logf("1 GiB ext4, first stage (mkfs): ceph-csi+rbd-nbd stage %s unstage %s; rbd-nbd-go CSI stage %s unstage %s",
		s1.Round(time.Millisecond), u1.Round(time.Millisecond), s2.Round(time.Millisecond), u2.Round(time.Millisecond))
	t.Logf("same image, second stage: ceph-csi+rbd-nbd stage %s unstage %s; rbd-nbd-go CSI stage %s unstage %s",
		s3.Round(time.Millisecond), u3.Round(time.Millisecond), s4.Round(time.Millisecond), u4.Round(time.Millisecond))
	_, err := r.cc.DeleteVolume(r.ctx, &csi.DeleteVolumeRequest{VolumeId: r.vol.VolumeId, Secrets: secrets()})
	r.must("DeleteVolume", err)
}
