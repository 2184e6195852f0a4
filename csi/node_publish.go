package csi

import (
	"context"
	"os"
	"path/filepath"
	"slices"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/mount-utils"
)

// NodePublishVolume bind-mounts the staged volume at the target: the
// staging path for a filesystem (a directory target), the device for
// raw block (a file target).
func (d *Driver) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	a, err := validateNodePublishVolumeRequest(req)
	if err != nil {
		return nil, err
	}
	id, target, staging := req.GetVolumeId(), req.GetTargetPath(), req.GetStagingTargetPath()
	release, err := d.locks.acquire(id)
	if err != nil {
		return nil, err
	}
	defer release()
	rec, ok, err := d.state.load(id)
	switch {
	case err != nil:
		return nil, status.Error(codes.Internal, err.Error())
	case !ok || rec.Device == "":
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s is not staged", id)
	case rec.StagingPath != staging:
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s is staged at %s, not %s", id, rec.StagingPath, staging)
	case a.Block != rec.Block:
		return nil, status.Errorf(codes.InvalidArgument, "volume %s is staged for %s access", id, accessName(rec.Block))
	}
	if dev, err := d.deviceOf(ctx, id); err != nil {
		return nil, err
	} else if dev != rec.Device {
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s: its device %s is no longer mapped", id, rec.Device)
	}
	others := slices.DeleteFunc(slices.Clone(rec.Published), func(p string) bool { return p == target })
	if (rec.SingleWriter || a.SingleWriter) && len(others) > 0 {
		return nil, status.Errorf(codes.FailedPrecondition,
			"volume %s is SINGLE_NODE_SINGLE_WRITER and already published at %s", id, others[0])
	}
	if notMnt, err := mount.IsNotMountPoint(d.cfg.Mounter, target); err == nil && !notMnt {
		rec.publish(target)
		return &csi.NodePublishVolumeResponse{}, d.saveStatus(rec)
	}
	made, err := makeTarget(target, rec.Block)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "create %s: %v", target, err)
	}
	source, opts := rec.StagingPath, []string{"bind"}
	if rec.Block {
		source = rec.Device
	} else {
		opts = append(opts, a.MountFlags...)
	}
	if req.GetReadonly() || rec.ReadOnly {
		opts = append(opts, "ro")
	}
	if err := d.cfg.Mounter.Mount(source, target, "", opts); err != nil {
		if made {
			removeIfExists(target)
		}
		return nil, status.Errorf(codes.Internal, "bind %s at %s: %v", source, target, err)
	}
	rec.publish(target)
	if err := d.saveStatus(rec); err != nil {
		return nil, err
	}
	d.log.Info("published", "volume", id, "at", target, "readonly", req.GetReadonly() || rec.ReadOnly)
	return &csi.NodePublishVolumeResponse{}, nil
}

func (d *Driver) saveStatus(rec stageRecord) error {
	if err := d.state.save(rec); err != nil {
		return status.Errorf(codes.Internal, "save stage record: %v", err)
	}
	return nil
}

// makeTarget creates a publish target: a directory for a filesystem, a
// file for raw block. made says whether it did.
func makeTarget(target string, block bool) (made bool, err error) {
	if _, err := os.Stat(target); err == nil {
		return false, nil
	}
	if err := os.MkdirAll(filepath.Dir(target), 0o750); err != nil {
		return false, err
	}
	if !block {
		return true, os.Mkdir(target, 0o750)
	}
	f, err := os.OpenFile(target, os.O_CREATE|os.O_EXCL|os.O_RDWR, 0o600)
	if err != nil {
		return false, err
	}
	return true, f.Close()
}

// NodeUnpublishVolume unmounts and removes the target. Repeats, and
// targets that do not exist, succeed.
func (d *Driver) NodeUnpublishVolume(ctx context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	if err := validateNodeUnpublishVolumeRequest(req); err != nil {
		return nil, err
	}
	id, target := req.GetVolumeId(), req.GetTargetPath()
	release, err := d.locks.acquire(id)
	if err != nil {
		return nil, err
	}
	defer release()
	if err := unmountAll(d.cfg.Mounter, target); err != nil {
		return nil, status.Errorf(codes.Internal, "unmount %s: %v", target, err)
	}
	if err := removeIfExists(target); err != nil {
		return nil, status.Errorf(codes.Internal, "remove %s: %v", target, err)
	}
	rec, ok, err := d.state.load(id)
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	if ok {
		rec.unpublish(target)
		if err := d.saveStatus(rec); err != nil {
			return nil, err
		}
	}
	d.log.Info("unpublished", "volume", id, "from", target)
	return &csi.NodeUnpublishVolumeResponse{}, nil
}
