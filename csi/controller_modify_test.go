package csi

import (
	"context"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
)

// metaOf is a volume's image metadata.
func (r *rig) metaOf(t *testing.T, volID string) map[string]string {
	t.Helper()
	v, err := parseVolumeID(volID)
	if err != nil {
		t.Fatal(err)
	}
	info, err := r.images.ImageInfo(fakeOpts, v.Spec)
	if err != nil {
		t.Fatal(err)
	}
	return info.Meta
}

func wantMeta(t *testing.T, what string, meta map[string]string, want map[string]string) {
	t.Helper()
	for k, v := range want {
		if got, ok := meta[k]; v == "" && ok || v != "" && got != v {
			t.Errorf("%s: metadata %s = %q, want %q", what, k, got, v)
		}
	}
}

func (r *rig) modify(id string, params map[string]string) error {
	_, err := r.d.ControllerModifyVolume(context.Background(), &csi.ControllerModifyVolumeRequest{VolumeId: id,
		MutableParameters: params, Secrets: goodSecrets})
	return err
}

// The StorageClass's QoS at create, recomputed at expand, changed by a
// modify: the keys given replace, the others stay; 0 removes.
func TestQoSCreateExpandModify(t *testing.T) {
	r := newRig(t)
	v := r.create(t, "q", 3<<30, map[string]string{"clusterID": "c1", "baseWriteIops": "100",
		"writeIopsPerGiB": "10", "maxWriteIops": "150", "baseVolSizeBytes": "1073741824", "baseBps": "1048576"})
	wantMeta(t, "created", r.metaOf(t, v.VolumeId), map[string]string{"conf_rbd_qos_write_iops_limit": "120",
		"conf_rbd_qos_bps_limit": "1048576", "rbd_base_qos_write_iops_limit": "100", "rbd_write_iops_per_gib_limit": "10",
		"rbd_max_qos_write_iops_limit": "150", "rbd_base_qos_vol_size": "1073741824", "conf_rbd_qos_iops_limit": ""})
	_, err := r.d.ControllerExpandVolume(context.Background(), &csi.ControllerExpandVolumeRequest{VolumeId: v.VolumeId,
		CapacityRange: &csi.CapacityRange{RequiredBytes: 20 << 30}, Secrets: goodSecrets})
	if err != nil {
		t.Fatal(err)
	}
	wantMeta(t, "expanded", r.metaOf(t, v.VolumeId), map[string]string{"conf_rbd_qos_write_iops_limit": "150",
		"conf_rbd_qos_bps_limit": "1048576"})
	if err := r.modify(v.VolumeId, map[string]string{"maxWriteIops": "300", "baseBps": "0", "baseReadIops": "50"}); err != nil {
		t.Fatal(err)
	}
	wantMeta(t, "modified", r.metaOf(t, v.VolumeId), map[string]string{"conf_rbd_qos_write_iops_limit": "290",
		"rbd_max_qos_write_iops_limit": "300", "conf_rbd_qos_bps_limit": "", "rbd_base_qos_bps_limit": "",
		"conf_rbd_qos_read_iops_limit": "50"})
	// Again: nothing to write, still fine.
	if err := r.modify(v.VolumeId, map[string]string{"maxWriteIops": "300"}); err != nil {
		t.Fatal(err)
	}
}

func TestQoSModifyRefusals(t *testing.T) {
	r := newRig(t)
	v := r.create(t, "q", 1<<30, nil)
	gone := volume{ClusterID: "c1", Spec: ceph.ImageSpec{Pool: "rbd", Image: imageName("gone")}}.ID()
	for _, tc := range []struct {
		what   string
		id     string
		params map[string]string
		code   codes.Code
		says   string
	}{
		{"no volume ID", "", map[string]string{"maxIops": "1"}, codes.InvalidArgument, "volume ID"},
		{"unknown key", v.VolumeId, map[string]string{"XXX_FakeKey": "x"}, codes.InvalidArgument, `"XXX_FakeKey"`},
		{"a StorageClass-only key", v.VolumeId, map[string]string{"pool": "other"}, codes.InvalidArgument, `"pool"`},
		{"bad value", v.VolumeId, map[string]string{"maxIops": "lots"}, codes.InvalidArgument, `"maxIops"`},
		{"bad key before the lookup", gone, map[string]string{"XXX_FakeKey": "x"}, codes.InvalidArgument, "XXX_FakeKey"},
		{"perGiB without base", v.VolumeId, map[string]string{"iopsPerGiB": "3"}, codes.InvalidArgument, `needs "baseIops"`},
		{"not our ID", "non-existing-volume-id", map[string]string{"maxIops": "1"}, codes.NotFound, ""},
		{"no such image", gone, map[string]string{"maxIops": "1"}, codes.NotFound, "does not exist"},
	} {
		wantCode(t, tc.what, r.modify(tc.id, tc.params), tc.code, tc.says)
	}
	// A base given earlier lets a perGiB come later.
	if err := r.modify(v.VolumeId, map[string]string{"baseIops": "100"}); err != nil {
		t.Fatal(err)
	}
	if err := r.modify(v.VolumeId, map[string]string{"iopsPerGiB": "3"}); err != nil {
		t.Fatal(err)
	}
}

// A VolumeAttributesClass at create goes over the StorageClass; a bad
// one creates nothing.
func TestQoSMutableParametersAtCreate(t *testing.T) {
	r := newRig(t)
	create := func(name string, mutable map[string]string) (*csi.Volume, error) {
		resp, err := r.d.CreateVolume(context.Background(), &csi.CreateVolumeRequest{Name: name,
			CapacityRange:      &csi.CapacityRange{RequiredBytes: 1 << 30},
			VolumeCapabilities: []*csi.VolumeCapability{mountCap("ext4", rwo)}, Secrets: goodSecrets,
			Parameters:        map[string]string{"clusterID": "c1", "baseIops": "100", "maxIops": "500"},
			MutableParameters: mutable})
		return resp.GetVolume(), err
	}
	v, err := create("vac", map[string]string{"baseIops": "200"})
	if err != nil {
		t.Fatal(err)
	}
	wantMeta(t, "with a VAC", r.metaOf(t, v.VolumeId), map[string]string{"conf_rbd_qos_iops_limit": "200",
		"rbd_max_qos_iops_limit": "500"})
	_, err = create("bad", map[string]string{"XXX_FakeKey": "x"})
	wantCode(t, "a bad VAC", err, codes.InvalidArgument, "XXX_FakeKey")
	_, err = create("bad", map[string]string{"baseIops": "900"})
	wantCode(t, "a VAC's base above the StorageClass's max", err, codes.InvalidArgument, "above")
	if n := len(r.imageNames()); n != 1 {
		t.Fatalf("%d images; the refused calls made some", n)
	}
}

// A restore takes its own StorageClass's QoS, not what librbd copied
// from its source's metadata.
func TestQoSRestoreTakesItsOwn(t *testing.T) {
	r := newRig(t)
	src := r.create(t, "src", 1<<30, map[string]string{"clusterID": "c1", "baseWriteIops": "100", "baseBps": "5000"})
	s := r.snapshot(t, "snap", src.VolumeId)
	plain, err := r.restore("plain", snapSource(s.SnapshotId), 0)
	if err != nil {
		t.Fatal(err)
	}
	wantMeta(t, "restored without QoS", r.metaOf(t, plain.VolumeId), map[string]string{"conf_rbd_qos_write_iops_limit": "",
		"rbd_base_qos_write_iops_limit": "", "conf_rbd_qos_bps_limit": "", "rbd_base_qos_bps_limit": ""})
	own, err := r.restoreWith("own", snapSource(s.SnapshotId), 0, map[string]string{"clusterID": "c1", "baseWriteIops": "300"})
	if err != nil {
		t.Fatal(err)
	}
	wantMeta(t, "restored with its own", r.metaOf(t, own.VolumeId), map[string]string{"conf_rbd_qos_write_iops_limit": "300",
		"rbd_base_qos_write_iops_limit": "300", "conf_rbd_qos_bps_limit": ""})
}
