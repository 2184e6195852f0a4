package csi

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/mount-utils"
)

// NodeExpandVolume waits until the device shows the new size (the
// daemon's update watch on the image reconfigures the kernel device
// after ControllerExpand), then grows the filesystem.
func (d *Driver) NodeExpandVolume(ctx context.Context, req *csi.NodeExpandVolumeRequest) (*csi.NodeExpandVolumeResponse, error) {
	if err := validateNodeExpandVolumeRequest(req); err != nil {
		return nil, err
	}
	id, path := req.GetVolumeId(), req.GetVolumePath()
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
