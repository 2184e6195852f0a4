package csi

import (
	"context"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
)

func TestControllerPublish(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	v := r.create(t, "pvc-p", 1<<20, nil)
	c := mountCap("ext4", rwo)
	for _, tc := range []struct {
		name string
		req  *csi.ControllerPublishVolumeRequest
		code codes.Code
	}{
		{"no volume", &csi.ControllerPublishVolumeRequest{NodeId: "node-1", VolumeCapability: c}, codes.InvalidArgument},
		{"no node", &csi.ControllerPublishVolumeRequest{VolumeId: v.VolumeId, VolumeCapability: c}, codes.InvalidArgument},
		{"no capability", &csi.ControllerPublishVolumeRequest{VolumeId: v.VolumeId, NodeId: "node-1"}, codes.InvalidArgument},
		{"unknown node", &csi.ControllerPublishVolumeRequest{VolumeId: v.VolumeId, NodeId: "fake-node-id-1", VolumeCapability: c}, codes.NotFound},
		{"malformed volume", &csi.ControllerPublishVolumeRequest{VolumeId: "fake-vol-id-1", NodeId: "node-1", VolumeCapability: c}, codes.NotFound},
		{"missing volume", &csi.ControllerPublishVolumeRequest{VolumeId: "nbd1/c1/rbd//nope", NodeId: "node-1", VolumeCapability: c}, codes.NotFound},
	} {
		_, err := r.d.ControllerPublishVolume(ctx, tc.req)
		wantCode(t, tc.name, err, tc.code)
	}
	resp, err := r.d.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: v.VolumeId,
		NodeId: "node-1", VolumeCapability: mountCap("ext4", csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY)})
	if err != nil || resp.PublishContext[publishReadOnly] != "true" {
		t.Fatalf("publish %+v %v", resp, err)
	}
	if _, err := r.d.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: "gone", NodeId: "node-1"}); err != nil {
		t.Fatal(err)
	}
	vr, err := r.d.ValidateVolumeCapabilities(ctx, &csi.ValidateVolumeCapabilitiesRequest{VolumeId: v.VolumeId,
		VolumeCapabilities: []*csi.VolumeCapability{c}})
	if err != nil || vr.Confirmed == nil {
		t.Fatalf("validate %+v %v", vr, err)
	}
	vr, err = r.d.ValidateVolumeCapabilities(ctx, &csi.ValidateVolumeCapabilitiesRequest{VolumeId: v.VolumeId,
		VolumeCapabilities: []*csi.VolumeCapability{mountCap("ext4", csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)}})
	if err != nil || vr.Confirmed != nil || vr.Message == "" {
		t.Fatalf("validate of a shared filesystem %+v %v", vr, err)
	}
	_, err = r.d.ValidateVolumeCapabilities(ctx, &csi.ValidateVolumeCapabilitiesRequest{VolumeId: "fake-vol-id-x",
		VolumeCapabilities: []*csi.VolumeCapability{c}})
	wantCode(t, "validate unknown", err, codes.NotFound)
}
