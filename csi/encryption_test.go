package csi

import (
	"context"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
	"github.com/rbd-nbd-go/rbd-nbd-go/control"
)

func encSecrets(pass string) map[string]string {
	s := maps.Clone(goodSecrets)
	s[secretPassphraseKey] = pass
	return s
}

// encRig has a KMS config with a metadata KMS "meta".
func encRig(t *testing.T) *rig {
	dir := t.TempDir()
	conf := filepath.Join(dir, "kms.json")
	os.WriteFile(conf, []byte(`{"meta":{"encryptionKMSType":"metadata"}}`), 0o600)
	return newRigWith(t, func(c *Config) { c.KMSConfig = conf })
}

func (r *rig) createEnc(name string, size int64, params, secrets map[string]string, src *csi.VolumeContentSource) (*csi.Volume, error) {
	resp, err := r.d.CreateVolume(context.Background(), &csi.CreateVolumeRequest{Name: name,
		CapacityRange:      &csi.CapacityRange{RequiredBytes: size},
		VolumeCapabilities: []*csi.VolumeCapability{mountCap("ext4", rwo)}, Parameters: params,
		Secrets: secrets, VolumeContentSource: src})
	return resp.GetVolume(), err
}

// An encrypted volume's image is formatted at creation with a key of its
// own, 16 MiB larger than the volume, and its volume context tells the
// node; its capacity, snapshot size and expansion count the usable bytes.
func TestEncryptedVolumeLife(t *testing.T) {
	r := encRig(t)
	params := map[string]string{"clusterID": "c1", "encrypted": "true", "encryptionKMSID": "meta"}
	v, err := r.createEnc("pvc-e", 64<<20, params, encSecrets("kek"), nil)
	if err != nil {
		t.Fatal(err)
	}
	info, _ := r.images.ImageInfo(fakeOpts, ceph.ImageSpec{Pool: "rbd", Image: imageName("pvc-e")})
	pass := info.Meta[fakeLUKS]
	switch {
	case v.CapacityBytes != 64<<20 || info.Size != 64<<20+luksHeaderBytes:
		t.Fatalf("capacity %d, image %d", v.CapacityBytes, info.Size)
	case len(pass) != 28 || pass == "kek":
		t.Fatalf("formatted with %q: want a random per-volume passphrase", pass)
	case info.Meta[metaEncrypted] != stateEncrypted || info.Meta[metaKMSID] != "meta" || info.Meta[metaDEKSalt] != v.VolumeId:
		t.Fatalf("metadata %v", info.Meta)
	case v.VolumeContext["encrypted"] != "true" || v.VolumeContext["encryptionKMSID"] != "meta":
		t.Fatalf("volume context %v", v.VolumeContext)
	}
	// A retry answers from the image, and a plain retry conflicts.
	if again, err := r.createEnc("pvc-e", 64<<20, params, encSecrets("kek"), nil); err != nil || again.CapacityBytes != 64<<20 {
		t.Fatalf("retry: %v %v", again, err)
	}
	_, err = r.createEnc("pvc-e", 64<<20, map[string]string{"clusterID": "c1"}, goodSecrets, nil)
	wantCode(t, "unencrypted retry", err, codes.AlreadyExists, "encrypted true")

	// The node gets the same passphrase for the map, and nothing else
	// keeps it.
	staging := filepath.Join(r.dir, "staging")
	os.Mkdir(staging, 0o750)
	req := r.stageReq(v, staging, mountCap("ext4", rwo))
	req.Secrets = encSecrets("kek")
	if _, err := r.d.NodeStageVolume(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	if m := r.att.maps[0]; m.Encryption.Passphrase != pass || m.Encryption.Format != "luks" {
		t.Fatalf("map asked for %q (%s)", m.Encryption.Passphrase, m.Encryption.Format)
	}
	if strings.Contains(r.logs.String(), pass) || strings.Contains(r.logs.String(), "kek") {
		t.Fatal("a passphrase reached the log")
	}
	if b, _ := os.ReadFile(filepath.Join(r.d.cfg.StateDir, "csi")); strings.Contains(string(b), pass) {
		t.Fatal("a passphrase reached the state directory")
	}

	s := r.snapshot(t, "snap-e", v.VolumeId)
	if s.SizeBytes != 64<<20 {
		t.Fatalf("snapshot size %d, want the volume's", s.SizeBytes)
	}
	exp, err := r.d.ControllerExpandVolume(context.Background(), &csi.ControllerExpandVolumeRequest{VolumeId: v.VolumeId,
		CapacityRange: &csi.CapacityRange{RequiredBytes: 128 << 20}, Secrets: goodSecrets,
		VolumeCapability: mountCap("ext4", rwo)})
	info, _ = r.images.ImageInfo(fakeOpts, ceph.ImageSpec{Pool: "rbd", Image: imageName("pvc-e")})
	if err != nil || exp.CapacityBytes != 128<<20 || info.Size != 128<<20+luksHeaderBytes {
		t.Fatalf("expand: %v, capacity %d, image %d", err, exp.GetCapacityBytes(), info.Size)
	}
}

// Bad KMS settings and Secrets fail before anything is made; staging
// with the wrong Secret leaves nothing on the node.
func TestEncryptionRefusals(t *testing.T) {
	r := encRig(t)
	ctx := context.Background()
	for _, c := range []struct {
		what    string
		params  map[string]string
		secrets map[string]string
		code    codes.Code
		sub     string
	}{
		{"file type", map[string]string{"encrypted": "true", "encryptionType": "file"}, encSecrets("x"), codes.InvalidArgument, "fscrypt"},
		{"bad bool", map[string]string{"encrypted": "yes please"}, encSecrets("x"), codes.InvalidArgument, "encrypted"},
		{"unknown KMS", map[string]string{"encrypted": "true", "encryptionKMSID": "nope"}, encSecrets("x"), codes.InvalidArgument, "nope"},
		{"no passphrase", map[string]string{"encrypted": "true"}, goodSecrets, codes.InvalidArgument, secretPassphraseKey},
	} {
		c.params["clusterID"] = "c1"
		_, err := r.createEnc("pvc-"+strings.ReplaceAll(c.what, " ", "-"), 1<<20, c.params, c.secrets, nil)
		wantCode(t, c.what, err, c.code, c.sub)
	}
	if n := len(r.imageNames()); n != 0 {
		t.Fatalf("refused calls left %d images", n)
	}

	v, err := r.createEnc("pvc-w", 1<<20, map[string]string{"clusterID": "c1", "encrypted": "true", "encryptionKMSID": "meta"},
		encSecrets("kek"), nil)
	if err != nil {
		t.Fatal(err)
	}
	staging := filepath.Join(r.dir, "staging")
	os.Mkdir(staging, 0o750)
	req := r.stageReq(v, staging, mountCap("ext4", rwo))
	req.Secrets = encSecrets("wrong")
	_, err = r.d.NodeStageVolume(ctx, req)
	wantCode(t, "stage with the wrong Secret", err, codes.PermissionDenied, "does not unwrap")
	r.nothingLeft(t, "wrong Secret", v.VolumeId, staging)
	req.Secrets = goodSecrets
	_, err = r.d.NodeStageVolume(ctx, req)
	wantCode(t, "stage without a passphrase", err, codes.InvalidArgument, secretPassphraseKey)
	r.nothingLeft(t, "no passphrase", v.VolumeId, staging)
	// The daemon's own refusal (librbd's LUKS header does not open).
	req.Secrets = encSecrets("kek")
	r.att.mapErr = ceph.ErrBadPassphrase
	_, err = r.d.NodeStageVolume(ctx, req)
	wantCode(t, "the daemon refuses the passphrase", err, codes.PermissionDenied, "LUKS")
	r.nothingLeft(t, "daemon refusal", v.VolumeId, staging)
}

// A restore or clone of an encrypted volume opens with its source's key,
// sealed again for it, and says so; it cannot drop or add encryption.
func TestEncryptedRestoreKeepsSourceKey(t *testing.T) {
	r := encRig(t)
	params := map[string]string{"clusterID": "c1", "encrypted": "true", "encryptionKMSID": "meta"}
	v, err := r.createEnc("pvc-src", 32<<20, params, encSecrets("kek"), nil)
	if err != nil {
		t.Fatal(err)
	}
	srcInfo, _ := r.images.ImageInfo(fakeOpts, ceph.ImageSpec{Pool: "rbd", Image: imageName("pvc-src")})
	s := r.snapshot(t, "snap", v.VolumeId)
	src := snapSource(s.SnapshotId)
	_, err = r.createEnc("plain", 0, map[string]string{"clusterID": "c1"}, goodSecrets, src)
	wantCode(t, "unencrypted restore", err, codes.InvalidArgument, "must set encrypted")
	_, err = r.createEnc("wrongkek", 0, params, encSecrets("other"), src)
	wantCode(t, "restore with another Secret", err, codes.PermissionDenied, "does not unwrap")
	// Deleted and kept for its snapshot: its ID changes, its key's salt
	// does not.
	r.deleteVolume(t, v.VolumeId)
	rv, err := r.createEnc("restored", 0, params, encSecrets("kek"), src)
	if err != nil {
		t.Fatal(err)
	}
	info, _ := r.images.ImageInfo(fakeOpts, ceph.ImageSpec{Pool: "rbd", Image: imageName("restored")})
	if rv.CapacityBytes != 32<<20 || info.Size != 32<<20+luksHeaderBytes {
		t.Fatalf("restore capacity %d, image %d", rv.CapacityBytes, info.Size)
	}
	if info.Meta[metaKeyOf] == "" || info.Meta[metaDEKSalt] != rv.VolumeId || info.Meta[metaDEK] == srcInfo.Meta[metaDEK] {
		t.Fatalf("restore's key metadata %v", info.Meta)
	}
	pass, err := r.d.volumeKey("meta", rv.VolumeId, info.Meta, nil, encSecrets("kek"))
	if err != nil || string(pass) != srcInfo.Meta[fakeLUKS] {
		t.Fatalf("the restore's key is not its source's: %v", err)
	}
	// A plain volume cannot give an encrypted clone.
	p, err := r.createEnc("p", 8<<20, map[string]string{"clusterID": "c1"}, goodSecrets, nil)
	if err != nil {
		t.Fatal(err)
	}
	_, err = r.createEnc("p-enc", 0, params, encSecrets("kek"), &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{
		Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: p.VolumeId}}})
	wantCode(t, "encrypted clone of a plain volume", err, codes.InvalidArgument, "not encrypted")
}

// A volume ceph-csi encrypted (its metadata, none of ours) stages as a
// static volume with the Secret's passphrase (default KMS), mapped with
// 512-byte sectors as ceph-csi's devices had.
func TestCephCSIEncryptedStaticVolume(t *testing.T) {
	r := encRig(t)
	spec := ceph.ImageSpec{Pool: "rbd", Image: "csi-vol-from-ceph-csi"}
	if err := r.images.CreateImage(fakeOpts, spec, ceph.NewImage{Size: 64 << 20,
		Meta: map[string]string{metaEncrypted: stateEncrypted}}); err != nil {
		t.Fatal(err)
	}
	v := &csi.Volume{VolumeId: volume{ClusterID: "c1", Spec: spec}.ID(),
		VolumeContext: map[string]string{"clusterID": "c1", "encrypted": "true"}}
	staging := filepath.Join(r.dir, "staging")
	os.Mkdir(staging, 0o750)
	req := r.stageReq(v, staging, mountCap("ext4", rwo))
	req.Secrets = encSecrets("their-passphrase")
	if _, err := r.d.NodeStageVolume(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	if m := r.att.maps[0]; m.Encryption.Passphrase != "their-passphrase" || m.BlockSize != 512 {
		t.Fatalf("mapped with %q, block size %d", m.Encryption.Passphrase, m.BlockSize)
	}
	// Set encrypted in the context of a plain image: refused, untouched.
	plain := ceph.ImageSpec{Pool: "rbd", Image: "plain"}
	r.images.CreateImage(fakeOpts, plain, ceph.NewImage{Size: 64 << 20})
	pv := &csi.Volume{VolumeId: volume{ClusterID: "c1", Spec: plain}.ID(),
		VolumeContext: map[string]string{"clusterID": "c1", "encrypted": "true"}}
	s2 := filepath.Join(r.dir, "staging2")
	os.Mkdir(s2, 0o750)
	req = r.stageReq(pv, s2, mountCap("ext4", rwo))
	req.Secrets = encSecrets("x")
	_, err := r.d.NodeStageVolume(context.Background(), req)
	wantCode(t, "encrypted context, plain image", err, codes.FailedPrecondition, "no rbd.csi.ceph.com/encrypted")
}

// A ceph-csi volume's sealed key opens under the ceph-csi volume ID the
// static volume gives, and only that ID is kept as its salt: a stage
// under the default KMS first must not record a wrong one.
func TestCephCSISealedKeySalt(t *testing.T) {
	r := encRig(t)
	cephID := "0001-0003-c1-0000000000000001-abcd"
	sealed, _ := metadataKMS("kek").wrap(cephID, []byte("their-dek"))
	spec := ceph.ImageSpec{Pool: "rbd", Image: "csi-vol-sealed"}
	meta := map[string]string{metaEncrypted: stateEncrypted}
	maps.Copy(meta, sealed)
	r.images.CreateImage(fakeOpts, spec, ceph.NewImage{Size: 64 << 20, Meta: meta})
	id := volume{ClusterID: "c1", Spec: spec}.ID()
	stage := func(ctx map[string]string) control.Record {
		t.Helper()
		staging := filepath.Join(r.dir, "staging")
		os.MkdirAll(staging, 0o750)
		req := r.stageReq(&csi.Volume{VolumeId: id, VolumeContext: ctx}, staging, mountCap("ext4", rwo))
		req.Secrets = encSecrets("kek")
		if _, err := r.d.NodeStageVolume(context.Background(), req); err != nil {
			t.Fatal(err)
		}
		m := r.att.maps[len(r.att.maps)-1]
		if _, err := r.d.NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{VolumeId: id,
			StagingTargetPath: staging}); err != nil {
			t.Fatal(err)
		}
		return m
	}
	if m := stage(map[string]string{"clusterID": "c1", "encrypted": "true"}); m.Encryption.Passphrase != "kek" {
		t.Fatalf("default KMS mapped with %q", m.Encryption.Passphrase)
	}
	if info, _ := r.images.ImageInfo(fakeOpts, spec); info.Meta[metaDEKSalt] != "" {
		t.Fatalf("a default-KMS stage recorded salt %q", info.Meta[metaDEKSalt])
	}
	m := stage(map[string]string{"clusterID": "c1", "encrypted": "true", "encryptionKMSID": "meta", ctxCephCSIVolumeID: cephID})
	if m.Encryption.Passphrase != "their-dek" {
		t.Fatalf("metadata KMS mapped with %q", m.Encryption.Passphrase)
	}
	if info, _ := r.images.ImageInfo(fakeOpts, spec); info.Meta[metaDEKSalt] != cephID {
		t.Fatalf("salt kept: %q", info.Meta[metaDEKSalt])
	}
}
