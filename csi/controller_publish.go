package csi

import (
	"context"
	"errors"
	"strconv"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
)

// ControllerPublish/Unpublish exist for attachRequired: true. Kubernetes
// only runs its guard against attaching an RWO volume to two nodes
// (VolumeAttachment objects, the attach-detach controller's multi-attach
// check) for drivers that require attach; ceph-csi's rbd driver requires
// it for the same reason. The attach itself happens on the node
// (NodeStage maps the image): Publish checks that the volume and node
// exist and says, in the publish context, whether the node must map it
// read-only.

// publishReadOnly is the publish context key NodeStage reads.
const publishReadOnly = "readOnly"

func (d *Driver) ControllerPublishVolume(ctx context.Context, req *csi.ControllerPublishVolumeRequest) (*csi.ControllerPublishVolumeResponse, error) {
	a, err := validateControllerPublishVolumeRequest(req)
	if err != nil {
		return nil, err
	}
	id, node := req.GetVolumeId(), req.GetNodeId()
	vol, err := parseVolumeID(id)
	if err != nil {
		return nil, status.Error(codes.NotFound, err.Error())
	}
	if err := d.checkNode(ctx, node); err != nil {
		return nil, err
	}
	if err := d.checkExists(vol, req.GetSecrets()); err != nil {
		return nil, err
	}
	ro := req.GetReadonly() || a.ReadOnly
	return &csi.ControllerPublishVolumeResponse{PublishContext: map[string]string{
		publishReadOnly: strconv.FormatBool(ro)}}, nil
}

func (d *Driver) checkNode(ctx context.Context, node string) error {
	if d.cfg.Nodes == nil {
		return nil
	}
	ok, err := d.cfg.Nodes.NodeExists(ctx, node)
	if err != nil {
		return status.Errorf(codes.Unavailable, "look up node %q: %v", node, err)
	}
	if !ok {
		return status.Errorf(codes.NotFound, "node %q runs no %s node plugin", node, d.cfg.Name)
	}
	return nil
}

// checkExists answers NotFound for a volume whose image is gone. Without
// any credentials for its cluster (a controller restarted since the last
// call that carried secrets) it cannot look, and lets the call through:
// NodeStage, which has secrets, finds out.
func (d *Driver) checkExists(vol volume, secrets map[string]string) error {
	_, o, err := d.volumeAccess(vol.ID(), secrets, false)
	if status.Code(err) == codes.InvalidArgument {
		d.log.Info("cannot check that the volume exists: no credentials", "volume", vol.ID())
		return nil
	}
	if err != nil {
		return err
	}
	if _, err := d.cfg.Images.ImageInfo(o, vol.Spec); err != nil {
		if errors.Is(err, ceph.ErrImageNotFound) || errors.Is(err, ceph.ErrPoolNotFound) {
			return status.Errorf(codes.NotFound, "volume %s does not exist", vol.ID())
		}
		return cephStatus(err, "look up "+describe(vol))
	}
	return nil
}

// ControllerUnpublishVolume has nothing to undo on the controller: the
// node unmapped the image in NodeUnstage. Unknown and deleted volumes
// succeed too, as the spec asks.
func (d *Driver) ControllerUnpublishVolume(ctx context.Context, req *csi.ControllerUnpublishVolumeRequest) (*csi.ControllerUnpublishVolumeResponse, error) {
	if err := validateControllerUnpublishVolumeRequest(req); err != nil {
		return nil, err
	}
	return &csi.ControllerUnpublishVolumeResponse{}, nil
}

func (d *Driver) ValidateVolumeCapabilities(ctx context.Context, req *csi.ValidateVolumeCapabilitiesRequest) (*csi.ValidateVolumeCapabilitiesResponse, error) {
	if err := validateValidateVolumeCapabilitiesRequest(req); err != nil {
		return nil, err
	}
	vol, err := parseVolumeID(req.GetVolumeId())
	if err != nil {
		return nil, status.Error(codes.NotFound, err.Error())
	}
	if err := d.checkExists(vol, req.GetSecrets()); err != nil {
		return nil, err
	}
	if _, err := parseCapabilities(req.GetVolumeCapabilities()); err != nil {
		return &csi.ValidateVolumeCapabilitiesResponse{Message: err.Error()}, nil
	}
	return &csi.ValidateVolumeCapabilitiesResponse{Confirmed: &csi.ValidateVolumeCapabilitiesResponse_Confirmed{
		VolumeContext: req.GetVolumeContext(), VolumeCapabilities: req.GetVolumeCapabilities(),
		Parameters: req.GetParameters()}}, nil
}
