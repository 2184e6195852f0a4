package csi

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/mount-utils"

	"github.com/rbd-nbd-go/rbd-nbd-go/control"
)

// NodeGetVolumeStats: bytes and inodes of a filesystem; for raw block
// the capacity and, on fast-diff images, the bytes the image actually
// allocated — the daemon holds the image, so no secrets are needed.
func (d *Driver) NodeGetVolumeStats(ctx context.Context, req *csi.NodeGetVolumeStatsRequest) (*csi.NodeGetVolumeStatsResponse, error) {
	if err := validateNodeGetVolumeStatsRequest(req); err != nil {
		return nil, err
	}
	id, path := req.GetVolumeId(), req.GetVolumePath()
	fi, err := statVolumePath(path)
	if err != nil {
		return nil, err
	}
	if fi.Mode()&os.ModeDevice != 0 {
		return d.blockStats(ctx, id, path)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return nil, status.Errorf(codes.Internal, "statfs %s: %v", path, err)
	}
	bs := uint64(st.Bsize)
	return &csi.NodeGetVolumeStatsResponse{Usage: []*csi.VolumeUsage{
		{Unit: csi.VolumeUsage_BYTES, Total: int64(st.Blocks * bs), Available: int64(st.Bavail * bs),
			Used: int64((st.Blocks - st.Bfree) * bs)},
		{Unit: csi.VolumeUsage_INODES, Total: int64(st.Files), Available: int64(st.Ffree),
			Used: int64(st.Files - st.Ffree)},
	}}, nil
}

func (d *Driver) blockStats(ctx context.Context, id, path string) (*csi.NodeGetVolumeStatsResponse, error) {
	size, err := blockSize(path)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "size of %s: %v", path, err)
	}
	u := &csi.VolumeUsage{Unit: csi.VolumeUsage_BYTES, Total: int64(size)}
	if dev, err := d.deviceOf(ctx, id); err == nil && dev != "" {
		if st, err := d.cfg.Daemon.Status(ctx, dev, true); err == nil && st.Used != nil {
			u.Used = int64(*st.Used)
			u.Available = max(int64(size)-u.Used, 0)
		}
	}
	return &csi.NodeGetVolumeStatsResponse{Usage: []*csi.VolumeUsage{u}}, nil
}

// blockSize is a block device's size: where its end is.
func blockSize(path string) (uint64, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	n, err := f.Seek(0, io.SeekEnd)
	return uint64(n), err
}

// NodeGetVolumeHealth reports a volume INACCESSIBLE when the daemon is
// not serving its device (it lost the image, or it is detached), when
// none of the device's connections is live, or when its staging or
// publish mount is gone.
func (d *Driver) NodeGetVolumeHealth(ctx context.Context, req *csi.NodeGetVolumeHealthRequest) (*csi.NodeGetVolumeHealthResponse, error) {
	if err := validateNodeGetVolumeHealthRequest(req); err != nil {
		return nil, err
	}
	id := req.GetVolumeId()
	rec, ok, err := d.state.load(id)
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	if !ok {
		return nil, status.Errorf(codes.NotFound, "volume %s is not staged on this node", id)
	}
	h := &csi.VolumeHealth{VolumeId: id}
	bad := func(reason, format string, args ...any) {
		h.HealthStatuses = append(h.HealthStatuses, &csi.VolumeHealth_VolumeHealthEntry{
			Status: csi.VolumeHealthErrorType_INACCESSIBLE, Reason: reason, Message: fmt.Sprintf(format, args...)})
	}
	st, err := d.cfg.Daemon.Status(ctx, rec.Device, false)
	switch {
	case errors.Is(err, control.ErrNotMapped):
		bad("DeviceLost", "the node daemon no longer serves %s", rec.Device)
	case err != nil:
		bad("DaemonUnavailable", "the node daemon does not answer: %v", err)
	case st.Record.Cookie != id:
		bad("DeviceLost", "%s now serves another volume", rec.Device)
	case !st.Served:
		bad("DeviceDetached", "%s is detached from its image", rec.Device)
	case st.Live == 0:
		bad("ConnectionsDead", "none of the %d connections of %s is live", st.Connections, rec.Device)
	}
	for _, p := range []string{rec.stageTarget(), req.GetVolumePublishPath()} {
		if p == "" {
			continue
		}
		if notMnt, err := mount.IsNotMountPoint(d.cfg.Mounter, p); err != nil || notMnt {
			bad("NotMounted", "%s is not mounted", p)
		}
	}
	return &csi.NodeGetVolumeHealthResponse{VolumeHealth: h}, nil
}

// statVolumePath: NotFound for a volume path that does not exist.
func statVolumePath(path string) (os.FileInfo, error) {
	fi, err := os.Stat(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, status.Errorf(codes.NotFound, "volume path %s does not exist", path)
	}
	if err != nil {
		return nil, status.Errorf(codes.Internal, "stat %s: %v", path, err)
	}
	return fi, nil
}
