package csi

import (
	"context"
	"errors"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
)

// QoS on the controller: set at CreateVolume from the StorageClass and
// the VolumeAttributesClass (mutable parameters), recomputed at expand,
// changed by ControllerModifyVolume. The formula is in qos.go.

// ControllerModifyVolume changes a volume's QoS parameters (the only
// mutable ones): the keys given replace theirs, the others stay. The
// limits are rewritten for the volume's size; a node that has it mapped
// picks them up when librbd next refreshes the open image (seconds),
// with no remap or remount.
func (d *Driver) ControllerModifyVolume(ctx context.Context, req *csi.ControllerModifyVolumeRequest) (*csi.ControllerModifyVolumeResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, missing("volume ID")
	}
	// Keys and values are checked before the lookup: a bad one is
	// InvalidArgument for any volume. Their combination is checked
	// with the volume's own parameters.
	if err := (qos{}).apply(req.GetMutableParameters()); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	vol, o, err := d.volumeAccess(id, req.GetSecrets(), true)
	if err != nil {
		return nil, err
	}
	release, err := d.locks.acquire(id)
	if err != nil {
		return nil, err
	}
	defer release()
	info, err := d.cfg.Images.ImageInfo(o, vol.Spec)
	switch {
	case errors.Is(err, ceph.ErrImageNotFound), errors.Is(err, ceph.ErrPoolNotFound):
		return nil, status.Errorf(codes.NotFound, "volume %s does not exist", id)
	case err != nil:
		return nil, cephStatus(err, "look up "+describe(vol))
	}
	old, err := qosFromMeta(info.Meta)
	if err != nil {
		return nil, status.Errorf(codes.FailedPrecondition, "%s: %v", describe(vol), err)
	}
	q, err := old.with(req.GetMutableParameters())
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	if err := d.writeQoS(o, vol, info.Meta, q, usableBytes(info.Size, info.Meta)); err != nil {
		return nil, err
	}
	return &csi.ControllerModifyVolumeResponse{}, nil
}

// createQoS merges a CreateVolume's mutable parameters (its
// VolumeAttributesClass's) over the StorageClass's QoS parameters.
func createQoS(sc qos, mutable map[string]string) (qos, error) {
	q, err := sc.with(mutable)
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	return q, nil
}

// applyQoS gives a volume CreateVolume made (or found made) its QoS: a
// restore or clone takes the new StorageClass's, not the limits librbd
// copied from its source's metadata.
func (d *Driver) applyQoS(o ceph.Options, vol volume, q qos, v *csi.Volume) error {
	if len(q) == 0 && v.GetContentSource() == nil {
		return nil // a new plain image has no QoS metadata to clear
	}
	info, err := d.cfg.Images.ImageInfo(o, vol.Spec)
	if err != nil {
		return cephStatus(err, "look up "+describe(vol))
	}
	return d.writeQoS(o, vol, info.Meta, q, uint64(v.GetCapacityBytes()))
}

// resizeQoS recomputes an expanded volume's limits from its saved
// parameters (meta, read before the resize).
func (d *Driver) resizeQoS(o ceph.Options, vol volume, meta map[string]string, size uint64) error {
	q, err := qosFromMeta(meta)
	if err != nil {
		d.log.Warn("QoS parameters unreadable; limits not recomputed", "image", vol.Spec.String(), "err", err)
		return nil
	}
	if len(q) == 0 {
		return nil
	}
	return d.writeQoS(o, vol, meta, q, size)
}

// writeQoS writes what differs between meta and q at size.
func (d *Driver) writeQoS(o ceph.Options, vol volume, meta map[string]string, q qos, size uint64) error {
	set, rm := qosChanges(meta, q, size)
	if len(set) == 0 && len(rm) == 0 {
		return nil
	}
	if err := d.cfg.Images.UpdateMetadata(o, vol.Spec, set, rm); err != nil {
		return cephStatus(err, "set the QoS of "+describe(vol))
	}
	d.log.Info("QoS set", "image", vol.Spec.String(), "size", size, "limits", q.limits(size))
	return nil
}
