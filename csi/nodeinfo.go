package csi

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/mount-utils"

	"github.com/rbd-nbd-go/rbd-nbd-go/control"
)

func (d *Driver) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	// No per-node volume limit: netlink creates /dev/nbdN on demand.
	return &csi.NodeGetInfoResponse{NodeId: d.cfg.NodeID}, nil
}

func (d *Driver) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	var caps []*csi.NodeServiceCapability
	for _, t := range []csi.NodeServiceCapability_RPC_Type{
		csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME,
		csi.NodeServiceCapability_RPC_GET_VOLUME_STATS,
		csi.NodeServiceCapability_RPC_EXPAND_VOLUME,
		csi.NodeServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
		// Volume condition moved from NodeGetVolumeStats to
		// NodeGetVolumeHealth in CSI 1.13.
		csi.NodeServiceCapability_RPC_GET_VOLUME_HEALTH,
	} {
		caps = append(caps, &csi.NodeServiceCapability{Type: &csi.NodeServiceCapability_Rpc{
			Rpc: &csi.NodeServiceCapability_RPC{Type: t}}})
	}
	return &csi.NodeGetCapabilitiesResponse{Capabilities: caps}, nil
}

// NodeGetVolumeStats: bytes and inodes of a filesystem; for raw block
// the capacity and, on fast-diff images, the bytes the image actually
// allocated — the daemon holds the image, so no secrets are needed.
func (d *Driver) NodeGetVolumeStats(ctx context.Context, req *csi.NodeGetVolumeStatsRequest) (*csi.NodeGetVolumeStatsResponse, error) {
	id, path := req.GetVolumeId(), req.GetVolumePath()
	if err := require("volume ID", id, "volume path", path); err != nil {
		return nil, err
	}
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
		if st, err := d.cfg.Attacher.Status(ctx, dev, true); err == nil && st.Used != nil {
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

// NodeExpandVolume waits until the device shows the new size (the
// daemon's update watch on the image reconfigures the kernel device
// after ControllerExpand), then grows the filesystem.
func (d *Driver) NodeExpandVolume(ctx context.Context, req *csi.NodeExpandVolumeRequest) (*csi.NodeExpandVolumeResponse, error) {
	id, path := req.GetVolumeId(), req.GetVolumePath()
	if err := require("volume ID", id, "volume path", path); err != nil {
		return nil, err
	}
	fi, err := statVolumePath(path)
	if err != nil {
		return nil, err
	}
	release, err := d.locks.acquire(id)
	if err != nil {
		return nil, err
	}
	defer release()
	dev, err := d.deviceOf(ctx, id)
	if err != nil {
		return nil, err
	}
	if dev == "" {
		return nil, status.Errorf(codes.NotFound, "volume %s is not mapped on this node", id)
	}
	want := uint64(req.GetCapacityRange().GetRequiredBytes())
	size, err := d.waitDeviceSize(ctx, dev, want)
	if err != nil {
		return nil, err
	}
	block := fi.Mode()&os.ModeDevice != 0 || req.GetVolumeCapability().GetBlock() != nil
	if !block {
		if _, err := mount.NewResizeFs(d.cfg.Mounter.Exec).Resize(dev, path); err != nil {
			return nil, status.Errorf(codes.Internal, "grow the filesystem on %s: %v", dev, err)
		}
		d.log.Info("grew filesystem", "volume", id, "device", dev, "size", size)
	}
	return &csi.NodeExpandVolumeResponse{CapacityBytes: int64(size)}, nil
}

// waitDeviceSize polls /sys/block/nbdN/size until it reaches want bytes
// (0: any), bounded by DeviceWait.
func (d *Driver) waitDeviceSize(ctx context.Context, dev string, want uint64) (uint64, error) {
	sysSize := filepath.Join(d.cfg.SysBlock, filepath.Base(dev), "size")
	deadline := time.Now().Add(d.cfg.DeviceWait)
	for {
		b, err := os.ReadFile(sysSize)
		if err != nil {
			return 0, status.Errorf(codes.Internal, "size of %s: %v", dev, err)
		}
		sectors, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
		if err != nil {
			return 0, status.Errorf(codes.Internal, "size of %s: %v", dev, err)
		}
		if size := sectors * 512; size >= want {
			return size, nil
		}
		if time.Now().After(deadline) {
			return 0, status.Errorf(codes.DeadlineExceeded, "%s is still %d bytes, not %d, after %s",
				dev, sectors*512, want, d.cfg.DeviceWait)
		}
		select {
		case <-ctx.Done():
			return 0, status.FromContextError(ctx.Err()).Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// NodeGetVolumeHealth reports a volume INACCESSIBLE when the daemon is
// not serving its device (it lost the image, or it is detached), when
// none of the device's connections is live, or when its staging or
// publish mount is gone.
func (d *Driver) NodeGetVolumeHealth(ctx context.Context, req *csi.NodeGetVolumeHealthRequest) (*csi.NodeGetVolumeHealthResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "volume ID is required")
	}
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
	st, err := d.cfg.Attacher.Status(ctx, rec.Device, false)
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
