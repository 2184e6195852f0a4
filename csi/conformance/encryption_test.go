package conformance

import (
	"bytes"
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/crypto/scrypt"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Encrypted volumes on real /dev/nbd devices in the VM: librbd's LUKS2 in
// the node daemon, what reaches the OSDs, what a wrong Secret leaves,
// where the keys live, and ceph-csi's own encrypted volumes (cryptsetup
// on a mapped device) opening here.

// encRig is a volume rig whose plugin reads a KMS config with a metadata
// KMS "meta".
func encRig(t *testing.T) *volumeRig {
	needNode(t)
	dir := t.TempDir()
	kms := filepath.Join(dir, "kms.json")
	os.WriteFile(kms, []byte(`{"meta":{"encryptionKMSType":"metadata"}}`), 0o600)
	r := newVolumeRigIn(t, dir, "--kms-config", kms)
	return r
}

func encSecrets(kek string) map[string]string {
	s := secrets()
	s["encryptionPassphrase"] = kek
	return s
}

func (r *volumeRig) stageWith(sec map[string]string) error {
	os.MkdirAll(r.staging, 0o750)
	_, err := r.nc.NodeStageVolume(r.ctx, &csi.NodeStageVolumeRequest{VolumeId: r.vol.VolumeId, StagingTargetPath: r.staging,
		VolumeCapability: r.cap, Secrets: sec, VolumeContext: r.vol.VolumeContext, PublishContext: r.pubCtx})
	return err
}

// ourKeys lists the kernel keyring's rbd-nbd-go keys (by description).
func ourKeys(t *testing.T) []string {
	b, err := os.ReadFile("/proc/keys")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		if i := strings.Index(l, "rbd-nbd-go:"); i >= 0 {
			out = append(out, strings.Fields(l[i:])[0])
		}
	}
	return out
}

// keyOf reads the passphrase the daemon keeps for a device.
func keyOf(t *testing.T, desc string) string {
	id, err := unix.KeyctlSearch(unix.KEY_SPEC_USER_KEYRING, "user", strings.TrimSuffix(desc, ":"), 0)
	if err != nil {
		t.Fatalf("key %s: %v", desc, err)
	}
	buf := make([]byte, 256)
	n, err := unix.KeyctlBuffer(unix.KEYCTL_READ, id, buf, 0)
	if err != nil {
		t.Fatal(err)
	}
	return string(buf[:n])
}

// watchersAndLocks is what `rbd status` and `rbd lock ls` say of an image.
func watchersAndLocks(t *testing.T, image string) string {
	st := run(t, "rbd", "status", "rbd/"+image)
	locks := run(t, "rbd", "lock", "ls", "rbd/"+image)
	if strings.Contains(st, "Watchers: none") && strings.TrimSpace(locks) == "" {
		return ""
	}
	return st + locks
}

func TestEncryptedVolume(t *testing.T) {
	r := encRig(t)
	kek := "kek-" + hex.EncodeToString(randBytes(8))
	marker := []byte("PLAINTEXT-MARKER-" + hex.EncodeToString(randBytes(8)) + "\n")
	resp, err := r.cc.CreateVolume(r.ctx, &csi.CreateVolumeRequest{Name: "pvc-enc",
		CapacityRange: &csi.CapacityRange{RequiredBytes: 96 << 20}, VolumeCapabilities: []*csi.VolumeCapability{fsCap("ext4", rwo)},
		Parameters: map[string]string{"clusterID": "dev", "pool": "rbd", "encrypted": "true", "encryptionKMSID": "meta"},
		Secrets:    encSecrets(kek)})
	r.must("CreateVolume", err)
	r.vol, r.cap = resp.Volume, fsCap("ext4", rwo)
	image := imageOf(r.vol.VolumeId)

	// A wrong Secret: PermissionDenied, and nothing left anywhere.
	pub, err := r.cc.ControllerPublishVolume(r.ctx, &csi.ControllerPublishVolumeRequest{VolumeId: r.vol.VolumeId,
		NodeId: "sanity-node", VolumeCapability: r.cap})
	r.must("ControllerPublish", err)
	r.pubCtx = pub.PublishContext
	err = r.stageWith(encSecrets("not-" + kek))
	if status.Code(err) != codes.PermissionDenied {
		t.Fatalf("staging with the wrong Secret: %v, want PermissionDenied", err)
	}
	if m := r.mapped(); strings.Contains(m, image) {
		t.Fatalf("a wrong Secret left a mapping: %s", m)
	}
	if wl := watchersAndLocks(t, image); wl != "" {
		t.Fatalf("a wrong Secret left watchers or locks:\n%s", wl)
	}
	if ents, _ := os.ReadDir(r.staging); len(ents) != 0 {
		t.Fatalf("a wrong Secret left %v in the staging path", ents)
	}
	if k := ourKeys(t); len(k) != 0 {
		t.Fatalf("a wrong Secret left keys: %v", k)
	}

	r.must("NodeStage", r.stageWith(encSecrets(kek)))
	keys := ourKeys(t)
	if len(keys) != 1 {
		t.Fatalf("keyring holds %v, want one key for the device", keys)
	}
	pass := keyOf(t, keys[0])
	target := r.publish("a", false)
	data := bytes.Repeat(marker, (4<<20)/len(marker))
	if err := os.WriteFile(filepath.Join(target, "plain"), data, 0o644); err != nil {
		t.Fatal(err)
	}
	unix.Sync()
	snap := r.snapshot("snap-enc")

	// Ciphertext is all the OSDs have, behind a LUKS header.
	raw := export(t, image)
	if !bytes.HasPrefix(raw, []byte("LUKS\xba\xbe")) {
		t.Fatalf("the image starts with %q, not a LUKS header", raw[:6])
	}
	if bytes.Contains(raw, marker[:24]) {
		t.Fatal("plaintext reached the OSDs")
	}

	// Online expand: librbd shows the device the new size less the header.
	before := fsSize(t, target)
	_, err = r.cc.ControllerExpandVolume(r.ctx, &csi.ControllerExpandVolumeRequest{VolumeId: r.vol.VolumeId,
		CapacityRange: &csi.CapacityRange{RequiredBytes: 192 << 20}, VolumeCapability: r.cap, Secrets: secrets()})
	r.must("ControllerExpand", err)
	_, err = r.nc.NodeExpandVolume(r.ctx, &csi.NodeExpandVolumeRequest{VolumeId: r.vol.VolumeId, VolumePath: target,
		StagingTargetPath: r.staging, VolumeCapability: r.cap, CapacityRange: &csi.CapacityRange{RequiredBytes: 192 << 20}})
	r.must("NodeExpand", err)
	if after := fsSize(t, target); after < before+80<<20 {
		t.Fatalf("filesystem %d -> %d bytes: not grown", before, after)
	} else {
		t.Logf("encrypted ext4 grew online from %d to %d MiB", before>>20, after>>20)
	}

	// Every process of the plugin killed: the new daemon reads the
	// passphrase back from the keyring and serves the device again.
	r.p.signal(unix.SIGKILL)
	r.p.start()
	r.nc, r.cc = csi.NewNodeClient(r.p.conn), csi.NewControllerClient(r.p.conn)
	if err := os.WriteFile(filepath.Join(target, "after-restart"), marker, 0o644); err != nil {
		t.Fatalf("write after the restart: %v", err)
	}
	unix.Sync()
	sameFile(t, filepath.Join(target, "plain"), data, "after the restart")

	// The restore opens with its source's key.
	rr := r.another("restored")
	resp, err = rr.cc.CreateVolume(rr.ctx, &csi.CreateVolumeRequest{Name: "pvc-enc-restored",
		VolumeCapabilities: []*csi.VolumeCapability{fsCap("ext4", rwo)}, VolumeContentSource: snapSrc(snap.SnapshotId),
		Parameters: map[string]string{"clusterID": "dev", "pool": "rbd", "encrypted": "true", "encryptionKMSID": "meta"},
		Secrets:    encSecrets(kek)})
	rr.must("CreateVolume from the snapshot", err)
	rr.vol, rr.cap = resp.Volume, fsCap("ext4", rwo)
	pub, err = rr.cc.ControllerPublishVolume(rr.ctx, &csi.ControllerPublishVolumeRequest{VolumeId: rr.vol.VolumeId,
		NodeId: "sanity-node", VolumeCapability: rr.cap})
	rr.must("ControllerPublish restore", err)
	rr.pubCtx = pub.PublishContext
	rr.must("NodeStage restore", rr.stageWith(encSecrets(kek)))
	rt := rr.publish("b", false)
	sameFile(t, filepath.Join(rt, "plain"), data, "the restore")
	if meta := run(t, "rbd", "image-meta", "get", "rbd/"+imageOf(rr.vol.VolumeId), "rbd-nbd-go.csi.io/encryption-key-of"); strings.TrimSpace(meta) == "" {
		t.Fatal("the restore does not say whose key it opens with")
	}

	rr.unpublish(rt)
	rr.detach()
	r.unpublish(target)
	r.detach()
	rr.delete()
	_, err = r.cc.DeleteSnapshot(r.ctx, &csi.DeleteSnapshotRequest{SnapshotId: snap.SnapshotId, Secrets: secrets()})
	r.must("DeleteSnapshot", err)
	r.delete()
	if k := ourKeys(t); len(k) != 0 {
		t.Fatalf("keys left after unstage: %v", k)
	}
	for _, f := range []string{r.p.log, filepath.Join(r.p.dir, "state", "daemon.log")} {
		if s := readFile(f); strings.Contains(s, kek) || strings.Contains(s, pass) {
			t.Fatalf("a passphrase is in %s", f)
		}
	}
	if out, _ := exec.Command("grep", "-rl", pass, filepath.Join(r.p.dir, "state")).Output(); len(out) != 0 {
		t.Fatalf("the passphrase is in the state directory: %s", out)
	}
}

func randBytes(n int) []byte {
	b := make([]byte, n)
	rand.Read(b)
	return b
}

// sealLikeCephCSI stores a passphrase as ceph-csi's metadata KMS does
// (internal/kms/secretskms.go): AES-256-GCM under scrypt(KEK, volume ID,
// N=32768, r=8, p=1), JSON {"dek","nonce"} in rbd.csi.ceph.com/dek.
// Written here from its description, apart from the driver's own code.
func sealLikeCephCSI(t *testing.T, kek, volID, pass string) string {
	key, err := scrypt.Key([]byte(kek), []byte(volID), 32768, 8, 1, 32)
	if err != nil {
		t.Fatal(err)
	}
	blk, _ := aes.NewCipher(key)
	gcm, _ := cipher.NewGCM(blk)
	nonce := randBytes(gcm.NonceSize())
	b, _ := json.Marshal(struct {
		DEK   []byte `json:"dek"`
		Nonce []byte `json:"nonce"`
	}{gcm.Seal(nil, nonce, []byte(pass), nil), nonce})
	return string(b)
}

// cephCSIVolume makes an image the way ceph-csi's node plugin encrypts
// one: mapped (Ceph's rbd-nbd), cryptsetup luksFormat --type luks2
// --hash sha256 --pbkdf-memory 32768 on the device with passes[0], more
// keyslots for the other passes (as ceph-csi's key rotation leaves one
// in slot 1), opened with dm-crypt, ext4 on that, a file written; then
// closed and unmapped.
func cephCSIVolume(t *testing.T, image string, passes []string, content []byte) {
	run(t, "rbd", "create", "--size", "128M", "--image-feature", "layering,exclusive-lock,object-map,fast-diff,deep-flatten", "rbd/"+image)
	dev := strings.TrimSpace(run(t, "rbd-nbd", "map", "rbd/"+image))
	defer run(t, "rbd-nbd", "unmap", dev)
	crypt := func(stdin string, args ...string) {
		t.Helper()
		cmd := exec.Command("cryptsetup", args...)
		cmd.Stdin = strings.NewReader(stdin)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("cryptsetup %v: %v\n%s", args, err, out)
		}
	}
	// ceph-csi's command lines (internal/util/cryptsetup.go).
	crypt(passes[0], "-q", "luksFormat", "--type", "luks2", "--hash", "sha256", "--pbkdf-memory", "32768", dev, "-d", "-")
	old := filepath.Join(t.TempDir(), "old")
	os.WriteFile(old, []byte(passes[0]), 0o600)
	for _, p := range passes[1:] {
		crypt(p, "-q", "luksAddKey", "--pbkdf-memory", "32768", "-d", old, dev, "-")
	}
	name := "luks-rbd-" + image
	crypt(passes[0], "luksOpen", dev, name, "--disable-keyring", "-d", "-")
	defer crypt("", "luksClose", name)
	run(t, "mkfs.ext4", "-q", "/dev/mapper/"+name)
	mnt := t.TempDir()
	run(t, "mount", "/dev/mapper/"+name, mnt)
	err := os.WriteFile(filepath.Join(mnt, "data"), content, 0o644)
	run(t, "umount", mnt)
	if err != nil {
		t.Fatal(err)
	}
}

// TestCephCSIEncryptedVolumeOpens: a volume ceph-csi encrypted stages
// here as a static volume, through librbd's LUKS loader, with its data:
// with its default KMS (the Secret's passphrase opens keyslot 0), and with
// its metadata KMS (a random passphrase in keyslot 1, sealed in the
// image's metadata under ceph-csi's volume ID). One image serves both.
func TestCephCSIEncryptedVolumeOpens(t *testing.T) {
	r := encRig(t)
	if _, err := exec.LookPath("cryptsetup"); err != nil {
		t.Fatal("cryptsetup is needed to make a volume as ceph-csi does")
	}
	kek := "kek-" + hex.EncodeToString(randBytes(8))
	// 20 random bytes, base64url, as ceph-csi makes them.
	dek := base64.URLEncoding.EncodeToString(randBytes(20))
	cephID := "0001-0003-dev-0000000000000001-" + hex.EncodeToString(randBytes(16))
	image := "csi-vol-migrated"
	content := append([]byte("ceph-csi wrote this\n"), randBytes(1<<20)...)
	cephCSIVolume(t, image, []string{kek, dek}, content)
	run(t, "rbd", "image-meta", "set", "rbd/"+image, "rbd.csi.ceph.com/encrypted", "encrypted")
	run(t, "rbd", "image-meta", "set", "rbd/"+image, "rbd.csi.ceph.com/dek", sealLikeCephCSI(t, kek, cephID, dek))
	for _, kind := range []string{"default", "metadata"} {
		t.Run(kind, func(t *testing.T) {
			ctx := map[string]string{"clusterID": "dev", "pool": "rbd", "encrypted": "true"}
			if kind == "metadata" {
				ctx["encryptionKMSID"], ctx["cephcsiVolumeID"] = "meta", cephID
			}
			rv := r.another("static-" + kind)
			rv.vol = &csi.Volume{VolumeId: "nbd1/dev/rbd//" + image, VolumeContext: ctx}
			rv.cap = fsCap("ext4", rwo)
			rv.must("NodeStage of ceph-csi's volume", rv.stageWith(encSecrets(kek)))
			target := rv.publish("m-"+kind, false)
			sameFile(t, filepath.Join(target, "data"), content, "ceph-csi's data")
			rv.unpublish(target)
			_, err := rv.nc.NodeUnstageVolume(rv.ctx, &csi.NodeUnstageVolumeRequest{VolumeId: rv.vol.VolumeId, StagingTargetPath: rv.staging})
			rv.must("NodeUnstage", err)
		})
	}
	run(t, "rbd", "rm", "--no-progress", "rbd/"+image)
}
