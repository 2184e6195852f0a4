package csi

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
)

// wantCode fails unless err has code c and its message contains each of
// subs.
func wantCode(t *testing.T, what string, err error, c codes.Code, subs ...string) {
	t.Helper()
	if status.Code(err) != c {
		t.Errorf("%s: got %v, want %v", what, err, c)
		return
	}
	for _, s := range subs {
		if !strings.Contains(status.Convert(err).Message(), s) {
			t.Errorf("%s: message %q does not say %q", what, status.Convert(err).Message(), s)
		}
	}
}

func TestCreateVolumeValidation(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	caps := []*csi.VolumeCapability{mountCap("ext4", rwo)}
	params := map[string]string{"clusterID": "c1"}
	for _, tc := range []struct {
		name string
		req  *csi.CreateVolumeRequest
		code codes.Code
		says string
	}{
		{"no name", &csi.CreateVolumeRequest{VolumeCapabilities: caps, Parameters: params, Secrets: goodSecrets}, codes.InvalidArgument, "name"},
		{"no capabilities", &csi.CreateVolumeRequest{Name: "v", Parameters: params, Secrets: goodSecrets}, codes.InvalidArgument, "capabilit"},
		{"unknown parameter", &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: caps, Secrets: goodSecrets,
			Parameters: map[string]string{"clusterID": "c1", "fsName": "x"}}, codes.InvalidArgument, `"fsName"`},
		{"no clusterID", &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: caps, Secrets: goodSecrets,
			Parameters: map[string]string{"pool": "rbd"}}, codes.InvalidArgument, "clusterID"},
		{"unknown clusterID", &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: caps, Secrets: goodSecrets,
			Parameters: map[string]string{"clusterID": "nope"}}, codes.InvalidArgument, `"nope" is not in the clusters config`},
		{"cluster without monitors", &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: caps, Secrets: goodSecrets,
			Parameters: map[string]string{"clusterID": "nomons"}}, codes.InvalidArgument, "no monitors"},
		{"bad feature", &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: caps, Secrets: goodSecrets,
			Parameters: map[string]string{"clusterID": "c1", "imageFeatures": "layering,turbo"}}, codes.InvalidArgument, `"imageFeatures": unknown RBD image feature "turbo"`},
		{"bad nbd map option", &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: caps, Secrets: goodSecrets,
			Parameters: map[string]string{"clusterID": "c1", "mapOptions": "krbd:lock_on_read;nbd:warp=9"}}, codes.InvalidArgument, "warp"},
		{"too many connections", &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: caps, Secrets: goodSecrets,
			Parameters: map[string]string{"clusterID": "c1", "mapOptions": "nbd:connections=99"}}, codes.InvalidArgument, "connections 99"},
		{"no secrets", &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: caps, Parameters: params}, codes.InvalidArgument, "userID"},
		{"wrong key", &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: caps, Parameters: params,
			Secrets: map[string]string{"userID": "csi", "userKey": "AQDwrong"}}, codes.PermissionDenied, "permission"},
		{"missing pool", &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: caps, Secrets: goodSecrets,
			Parameters: map[string]string{"clusterID": "c1", "pool": "gone"}}, codes.InvalidArgument, `"pool"`},
		{"limit below a MiB", &csi.CreateVolumeRequest{Name: "v", VolumeCapabilities: caps, Parameters: params, Secrets: goodSecrets,
			CapacityRange: &csi.CapacityRange{RequiredBytes: 1000, LimitBytes: 2000}}, codes.OutOfRange, "limit"},
		{"shared filesystem", &csi.CreateVolumeRequest{Name: "v", Parameters: params, Secrets: goodSecrets,
			VolumeCapabilities: []*csi.VolumeCapability{mountCap("ext4", csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)}},
			codes.InvalidArgument, "block access"},
		{"bad fstype", &csi.CreateVolumeRequest{Name: "v", Parameters: params, Secrets: goodSecrets,
			VolumeCapabilities: []*csi.VolumeCapability{mountCap("vfat", rwo)}}, codes.InvalidArgument, "vfat"},
		{"empty content source", &csi.CreateVolumeRequest{Name: "v", Parameters: params, Secrets: goodSecrets, VolumeCapabilities: caps,
			VolumeContentSource: &csi.VolumeContentSource{}}, codes.InvalidArgument, "neither a snapshot nor a volume"},
		{"unknown source snapshot", &csi.CreateVolumeRequest{Name: "v", Parameters: params, Secrets: goodSecrets, VolumeCapabilities: caps,
			VolumeContentSource: snapSource("snap1/c1/rbd//id9999/7")}, codes.NotFound, "does not exist"},
		{"source snapshot not ours", &csi.CreateVolumeRequest{Name: "v", Parameters: params, Secrets: goodSecrets, VolumeCapabilities: caps,
			VolumeContentSource: snapSource("csi-snap-1234")}, codes.NotFound, "not a snapshot ID"},
		{"unknown source volume", &csi.CreateVolumeRequest{Name: "v", Parameters: params, Secrets: goodSecrets, VolumeCapabilities: caps,
			VolumeContentSource: volSourceOf("nbd1/c1/rbd//nope")}, codes.NotFound, "does not exist"},
	} {
		_, err := r.d.CreateVolume(ctx, tc.req)
		wantCode(t, tc.name, err, tc.code, tc.says)
	}
	if len(r.images.images) != 0 {
		t.Fatalf("a refused request left images: %v", r.images.images)
	}
	// Secrets never in a message or the log.
	if strings.Contains(r.logs.String(), "AQD") {
		t.Fatal("a key reached the log")
	}
}

func TestCreateVolumeIdempotent(t *testing.T) {
	r := newRig(t)
	v1 := r.create(t, "pvc-1", 10<<20+1, nil)
	if v1.CapacityBytes != 11<<20 {
		t.Fatalf("capacity %d, want whole MiB above the request", v1.CapacityBytes)
	}
	if !strings.HasPrefix(v1.VolumeId, "nbd1/c1/rbd//csi-vol-") || v1.VolumeContext["clusterID"] != "c1" {
		t.Fatalf("volume %+v", v1)
	}
	v2 := r.create(t, "pvc-1", 10<<20+1, nil)
	if v2.VolumeId != v1.VolumeId || v2.CapacityBytes != v1.CapacityBytes || len(r.images.images) != 1 {
		t.Fatalf("repeat made another volume: %v %v", v1, v2)
	}
	info := r.images.images["rbd/"+imageName("pvc-1")]
	if info.Meta[metaName] != "pvc-1" || !slices.Contains(info.Features, "exclusive-lock") || !slices.Contains(info.Features, "fast-diff") {
		t.Fatalf("image %+v", info)
	}
	_, err := r.d.CreateVolume(context.Background(), &csi.CreateVolumeRequest{Name: "pvc-1",
		CapacityRange:      &csi.CapacityRange{RequiredBytes: 20 << 20, LimitBytes: 20 << 20},
		VolumeCapabilities: []*csi.VolumeCapability{mountCap("ext4", rwo)},
		Parameters:         map[string]string{"clusterID": "c1"}, Secrets: goodSecrets})
	wantCode(t, "same name, other size", err, codes.AlreadyExists, "pvc-1")
	// The namespace of the cluster's config is part of the ID.
	v3 := r.create(t, "pvc-ns", 1<<20, map[string]string{"clusterID": "ns", "imageFeatures": "layering"})
	if v3.VolumeId != "nbd1/ns/rbd/tenant/"+imageName("pvc-ns") {
		t.Fatalf("namespaced volume ID %s", v3.VolumeId)
	}
	// RWO needs the lock: exclusive-lock is added to a layering-only list.
	if f := r.images.images["rbd/tenant/"+imageName("pvc-ns")].Features; !slices.Contains(f, "exclusive-lock") {
		t.Fatalf("features %v", f)
	}
}

func TestDeleteVolume(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	v := r.create(t, "pvc-d", 1<<20, nil)
	_, err := r.d.DeleteVolume(ctx, &csi.DeleteVolumeRequest{})
	wantCode(t, "no ID", err, codes.InvalidArgument)
	for _, id := range []string{"fake-vol-id", "nbd1/c1/rbd//nothing-here"} {
		if _, err := r.d.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id, Secrets: goodSecrets}); err != nil {
			t.Errorf("delete %s: %v", id, err)
		}
	}
	r.images.setWatchers("rbd/"+imageName("pvc-d"), 1)
	_, err = r.d.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v.VolumeId, Secrets: goodSecrets})
	wantCode(t, "mapped somewhere", err, codes.FailedPrecondition, "still mapped")
	if len(r.images.images) != 1 {
		t.Fatal("a mapped volume was deleted")
	}
	r.images.setWatchers("rbd/"+imageName("pvc-d"), 0)
	for range 2 {
		if _, err := r.d.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: v.VolumeId, Secrets: goodSecrets}); err != nil {
			t.Fatal(err)
		}
	}
	if len(r.images.images) != 0 {
		t.Fatal("not deleted")
	}
	_, err = r.d.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: "nbd1/gone/rbd//x", Secrets: goodSecrets})
	wantCode(t, "cluster not in the config", err, codes.InvalidArgument, "clusters config")
}

func TestExpandVolume(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	v := r.create(t, "pvc-e", 1<<20, nil)
	_, err := r.d.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: v.VolumeId, Secrets: goodSecrets})
	wantCode(t, "no range", err, codes.InvalidArgument)
	_, err = r.d.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: "nbd1/c1/rbd//nope",
		CapacityRange: &csi.CapacityRange{RequiredBytes: 2 << 20}, Secrets: goodSecrets})
	wantCode(t, "missing volume", err, codes.NotFound)
	resp, err := r.d.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: v.VolumeId,
		CapacityRange: &csi.CapacityRange{RequiredBytes: 3<<20 - 5}, Secrets: goodSecrets,
		VolumeCapability: mountCap("xfs", rwo)})
	if err != nil || resp.CapacityBytes != 3<<20 || !resp.NodeExpansionRequired {
		t.Fatalf("expand %+v %v", resp, err)
	}
	resp, err = r.d.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: v.VolumeId,
		CapacityRange: &csi.CapacityRange{RequiredBytes: 2 << 20}, VolumeCapability: blockCap(rwo), Secrets: goodSecrets})
	if err != nil || resp.CapacityBytes != 3<<20 || resp.NodeExpansionRequired {
		t.Fatalf("no shrink, block needs no node step: %+v %v", resp, err)
	}
	// A write never borrows credentials another request carried.
	_, err = r.d.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: v.VolumeId,
		CapacityRange: &csi.CapacityRange{RequiredBytes: 4 << 20}})
	wantCode(t, "expand without secrets", err, codes.InvalidArgument, "userID")
}

// The provisioner's PVC name and namespace (--extra-create-metadata) go
// to the image's metadata under its own keys, and through the volume
// context to the node's map: the daemon's metrics label the device with
// them. A clone takes its own PVC's, not its source's.
func TestPVCOwnerReachesTheMap(t *testing.T) {
	r := newRig(t)
	params := map[string]string{"clusterID": "c1", "pool": "rbd", keyPVCName: "data", keyPVCNamespace: "shop",
		keyPVName: "pvc-1234"}
	v := r.create(t, "pvc-1234", 64<<20, params)
	o := ceph.Options{Key: "AQDkey", MonHost: "m"}
	info, err := r.images.ImageInfo(o, ceph.ImageSpec{Pool: "rbd", Image: imageName("pvc-1234")})
	if err != nil {
		t.Fatal(err)
	}
	if info.Meta[keyPVCName] != "data" || info.Meta[keyPVCNamespace] != "shop" || info.Meta[keyPVName] != "pvc-1234" {
		t.Fatalf("image metadata %v", info.Meta)
	}
	if c := v.VolumeContext; c["pvcName"] != "data" || c["pvcNamespace"] != "shop" {
		t.Fatalf("volume context %v", c)
	}
	staging := filepath.Join(r.dir, "staging")
	os.Mkdir(staging, 0o750)
	if _, err := r.d.NodeStageVolume(context.Background(), r.stageReq(v, staging, mountCap("ext4", rwo))); err != nil {
		t.Fatal(err)
	}
	if m := r.att.maps[0]; m.PVC != "data" || m.PVCNamespace != "shop" {
		t.Fatalf("map asked with PVC %q in %q", m.PVC, m.PVCNamespace)
	}
	clone, err := r.restore("pvc-5678", volSourceOf(v.VolumeId), 0)
	if err != nil {
		t.Fatal(err)
	}
	info, _ = r.images.ImageInfo(o, ceph.ImageSpec{Pool: "rbd", Image: imageName("pvc-5678")})
	if _, ok := info.Meta[keyPVCName]; ok || clone.VolumeContext["pvcName"] != "" {
		t.Fatalf("a clone made without a PVC kept its source's: %v %v", info.Meta, clone.VolumeContext)
	}
}
