package csi

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/mount-utils"

	"github.com/rbd-nbd-go/rbd-nbd-go/control"
)

// mkfs options unless the StorageClass's mkfsOptions say otherwise, as
// ceph-csi has them: no discard pass over a thin image, lazy inode and
// journal init so a large volume formats in seconds (mount-utils adds
// -F -m0 for ext4, -f for xfs).
func defaultMkfs(fs string) []string {
	if fs == "xfs" {
		return []string{"-K"}
	}
	return []string{"-E", "nodiscard,lazy_itable_init=1,lazy_journal_init=1"}
}

// NodeStageVolume maps the image through the node daemon and formats and
// mounts it (or binds the raw device) at the staging path. It is a
// transaction: a failure at any step undoes the earlier ones in reverse,
// leaving no mount, no file or directory we made, no mapping (and so no
// image lock) and no record.
func (d *Driver) NodeStageVolume(ctx context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	a, err := validateNodeStageVolumeRequest(req)
	if err != nil {
		return nil, err
	}
	id, staging := req.GetVolumeId(), req.GetStagingTargetPath()
	mo, err := parseMapOptions(req.GetVolumeContext()["mapOptions"], d.mapDefaults())
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "mapOptions: %v", err)
	}
	release, err := d.locks.acquire(id)
	if err != nil {
		return nil, err
	}
	defer release()
	vol, err := parseVolumeID(id)
	if err != nil {
		return nil, status.Error(codes.NotFound, err.Error())
	}
	creds, err := credentialsFrom(req.GetSecrets())
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	cl, err := d.clusters.get(vol.ClusterID)
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	if old, ok, err := d.state.load(id); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	} else if ok {
		if old.StagingPath != staging {
			return nil, status.Errorf(codes.FailedPrecondition, "volume %s is staged at %s", id, old.StagingPath)
		}
		if old.Block != a.Block || old.FsType != a.FsType || old.ReadOnly != (a.ReadOnly ||
			req.GetPublishContext()[publishReadOnly] == "true") {
			return nil, status.Errorf(codes.AlreadyExists,
				"volume %s is staged with another capability (%s %s, read-only %v)", id, accessName(old.Block), old.FsType, old.ReadOnly)
		}
		if done, err := d.staged(ctx, old); err != nil || done {
			if err != nil {
				return nil, err
			}
			return &csi.NodeStageVolumeResponse{}, nil
		}
		// A stage that did not finish (a plugin killed mid-way): do it
		// again, taking over what it left.
	}
	ro := a.ReadOnly || req.GetPublishContext()[publishReadOnly] == "true"
	tx := &stageTx{d: d, rec: stageRecord{VolumeID: id, StagingPath: staging, Block: a.Block,
		FsType: a.FsType, MountFlags: a.MountFlags, ReadOnly: ro, SingleWriter: a.SingleWriter}}
	if old, ok, _ := d.state.load(id); ok {
		tx.rec.Published = old.Published // what an interrupted stage had published stays known
	}
	mo.ReadOnly, mo.Exclusive = ro, a.Exclusive && !ro
	// A snapshot of the volume (CreateSnapshot, or a clone of it) then
	// freezes the mounted filesystem first, through librbd's quiesce
	// watch in the node daemon: the snapshot is consistent, not merely
	// crash-consistent.
	mo.Quiesce = !ro
	dev := control.Record{Index: control.AnyIndex, Spec: vol.Spec.String(), Cookie: id, MapOptions: mo,
		Ceph: cl.options(creds, 0), PVC: req.GetVolumeContext()["pvcName"],
		PVCNamespace: req.GetVolumeContext()["pvcNamespace"]}
	if err := d.stageKey(cl.options(creds, controllerOSDTimeout), vol, req.GetVolumeContext(), req.GetSecrets(), &dev); err != nil {
		return nil, err
	}
	if err := tx.run(ctx, dev, req.GetVolumeContext()["mkfsOptions"]); err != nil {
		tx.undo(ctx)
		return nil, err
	}
	d.log.Info("staged", "volume", id, "device", tx.rec.Device, "at", staging, "block", a.Block, "fs", a.FsType)
	return &csi.NodeStageVolumeResponse{}, nil
}

// stageTx records each finished step of a stage, for undo.
type stageTx struct {
	d                   *Driver
	rec                 stageRecord
	saved, mapped       bool
	madeTarget, mounted bool
}

func (tx *stageTx) run(ctx context.Context, dev control.Record, mkfsOptions string) error {
	d, rec := tx.d, &tx.rec
	// 1. The record, before anything else: NodeUnstage gets no volume
	// context, and a plugin killed after the map must find the device.
	if err := d.state.save(*rec); err != nil {
		return status.Errorf(codes.Internal, "save stage record: %v", err)
	}
	tx.saved = true
	// 2. The device: one left mapped by an unfinished stage (our cookie
	// is the volume ID), or a new map through the daemon.
	device, err := d.deviceOf(ctx, rec.VolumeID)
	if err != nil {
		return err
	}
	// Marked before the call: a map that outlives our deadline still
	// completes in the daemon, and undo must find it (by cookie).
	tx.mapped = true
	if device == "" {
		got, err := d.cfg.Daemon.Map(ctx, dev)
		if err != nil {
			// Missing image: NotFound; wrong key: PermissionDenied;
			// lock held by another node: FailedPrecondition.
			return cephStatus(err, "map "+dev.Spec)
		}
		device = got.Device()
	}
	rec.Device = device
	if err := d.state.save(*rec); err != nil {
		return status.Errorf(codes.Internal, "save stage record: %v", err)
	}
	// 3. The staging target.
	target := rec.stageTarget()
	if rec.Block {
		f, err := os.OpenFile(target, os.O_CREATE|os.O_RDWR, 0o600)
		if err != nil {
			return status.Errorf(codes.Internal, "create %s: %v", target, err)
		}
		f.Close()
		tx.madeTarget = true
	} else if _, err := os.Stat(target); errors.Is(err, os.ErrNotExist) {
		if err := os.MkdirAll(target, 0o750); err != nil {
			return status.Errorf(codes.Internal, "create %s: %v", target, err)
		}
		tx.madeTarget = true
	} else if err != nil {
		return status.Errorf(codes.Internal, "staging path: %v", err)
	}
	// 4. Format when blank and mount, or bind the device.
	if rec.Block {
		opts := []string{"bind"}
		if rec.ReadOnly {
			opts = append(opts, "ro")
		}
		if err := d.cfg.Mounter.Mount(device, target, "", opts); err != nil {
			return status.Errorf(codes.Internal, "bind %s at %s: %v", device, target, err)
		}
		tx.mounted = true
		return nil
	}
	opts := append([]string{"_netdev"}, rec.MountFlags...)
	if rec.FsType == "xfs" {
		opts = append(opts, "nouuid") // clones and snapshots share the UUID
	}
	if rec.ReadOnly {
		opts = append(opts, "ro")
	}
	format := defaultMkfs(rec.FsType)
	if mkfsOptions != "" {
		format = strings.Fields(mkfsOptions)
	}
	if err := d.cfg.Mounter.FormatAndMountSensitiveWithFormatOptions(device, target, rec.FsType, opts, nil, format); err != nil {
		var me mount.MountError
		if errors.As(err, &me) && (me.Type == mount.UnformattedReadOnly || me.Type == mount.FilesystemMismatch) {
			return status.Errorf(codes.FailedPrecondition, "mount %s at %s: %v", device, target, err)
		}
		return status.Errorf(codes.Internal, "format and mount %s at %s: %v", device, target, err)
	}
	tx.mounted = true
	if rec.ReadOnly {
		return nil
	}
	// A volume restored or cloned larger than its source carries the
	// source's filesystem: grow it before the mount is handed out.
	// resize2fs and xfs_growfs do nothing when it already fills the
	// device.
	rs := mount.NewResizeFs(d.cfg.Mounter.Exec)
	if need, err := rs.NeedResize(device, target); err != nil {
		return status.Errorf(codes.Internal, "check the filesystem size on %s: %v", device, err)
	} else if need {
		if _, err := rs.Resize(device, target); err != nil {
			return status.Errorf(codes.Internal, "grow the filesystem on %s: %v", device, err)
		}
	}
	return nil
}

// undo reverses the finished steps. If a step cannot be undone the
// record stays, so NodeUnstage (or the next stage) can finish the job.
func (tx *stageTx) undo(ctx context.Context) {
	// The call's own deadline may be what failed it: undo gets its own.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Minute)
	defer cancel()
	d, rec := tx.d, tx.rec
	var errs []error
	target := rec.stageTarget()
	if tx.mounted {
		errs = append(errs, d.cfg.Mounter.Unmount(target))
	}
	if tx.madeTarget {
		errs = append(errs, removeIfExists(target))
	}
	if tx.mapped {
		errs = append(errs, d.unmapVolume(ctx, rec.VolumeID))
	}
	if err := errors.Join(errs...); err != nil {
		d.log.Error("stage failed and could not be fully undone; the record stays for unstage",
			"volume", rec.VolumeID, "err", err)
		return
	}
	if tx.saved {
		if err := d.state.remove(rec.VolumeID); err != nil {
			d.log.Error("remove stage record", "volume", rec.VolumeID, "err", err)
		}
	}
}

// staged reports whether rec's stage is complete: the target mounted and
// the device served. A mount whose device the daemon lost is an error.
func (d *Driver) staged(ctx context.Context, rec stageRecord) (bool, error) {
	if rec.Device == "" {
		return false, nil
	}
	notMnt, err := mount.IsNotMountPoint(d.cfg.Mounter, rec.stageTarget())
	if err != nil || notMnt {
		return false, nil
	}
	dev, err := d.deviceOf(ctx, rec.VolumeID)
	if err != nil {
		return false, err
	}
	if dev != rec.Device {
		return false, status.Errorf(codes.FailedPrecondition,
			"volume %s is mounted at %s but its device %s is gone: unstage it first", rec.VolumeID, rec.StagingPath, rec.Device)
	}
	return true, nil
}

// deviceOf finds the device mapped for a volume (its cookie), or "".
func (d *Driver) deviceOf(ctx context.Context, volID string) (string, error) {
	ls, err := d.cfg.Daemon.List(ctx)
	if err != nil {
		return "", status.Errorf(codes.Unavailable, "node daemon: %v", err)
	}
	for _, r := range ls.Devices {
		if r.Cookie == volID {
			return r.Device(), nil
		}
	}
	return "", nil
}

// unmapVolume unmaps the device of a volume, if it has one.
func (d *Driver) unmapVolume(ctx context.Context, volID string) error {
	dev, err := d.deviceOf(ctx, volID)
	if err != nil || dev == "" {
		return err
	}
	err = d.cfg.Daemon.UnmapCookie(ctx, dev, volID)
	if errors.Is(err, control.ErrNotMapped) {
		return nil
	}
	if errors.Is(err, control.ErrBusy) {
		return status.Errorf(codes.FailedPrecondition, "%s of volume %s is still in use: %v", dev, volID, err)
	}
	if err != nil {
		return status.Errorf(codes.Internal, "unmap %s: %v", dev, err)
	}
	d.log.Info("unmapped", "volume", volID, "device", dev)
	return nil
}

func removeIfExists(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// NodeUnstageVolume unmounts the staging target, unmaps the device and
// forgets the volume. Repeats, and volumes never staged, succeed.
func (d *Driver) NodeUnstageVolume(ctx context.Context, req *csi.NodeUnstageVolumeRequest) (*csi.NodeUnstageVolumeResponse, error) {
	if err := validateNodeUnstageVolumeRequest(req); err != nil {
		return nil, err
	}
	id, staging := req.GetVolumeId(), req.GetStagingTargetPath()
	release, err := d.locks.acquire(id)
	if err != nil {
		return nil, err
	}
	defer release()
	rec, ok, err := d.state.load(id)
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	if ok && rec.StagingPath != staging {
		// Staged elsewhere: this path is not the volume's staging; clean
		// it, and leave the staged volume (and its device) alone.
		if err := unmountAll(d.cfg.Mounter, staging); err != nil {
			return nil, status.Errorf(codes.Internal, "unmount %s: %v", staging, err)
		}
		return &csi.NodeUnstageVolumeResponse{}, nil
	}
	if !ok {
		// No record (a node whose /run was wiped): what is mounted says
		// what it was. A mounted filesystem is not block, whatever files
		// it holds.
		rec = stageRecord{VolumeID: id, StagingPath: staging}
		if notMnt, err := mount.IsNotMountPoint(d.cfg.Mounter, staging); err != nil || notMnt {
			_, err := os.Stat(filepath.Join(staging, blockFile))
			rec.Block = err == nil
		}
	}
	// A published raw-block device looks idle to the daemon's busy check
	// (bind mounts and plain opens hold no exclusive claim): refuse while
	// a publish is still mounted.
	for _, p := range rec.Published {
		if notMnt, err := mount.IsNotMountPoint(d.cfg.Mounter, p); err == nil && !notMnt {
			return nil, status.Errorf(codes.FailedPrecondition, "volume %s is still published at %s", id, p)
		}
	}
	target := rec.stageTarget()
	if err := unmountAll(d.cfg.Mounter, target); err != nil {
		return nil, status.Errorf(codes.Internal, "unmount %s: %v", target, err)
	}
	if rec.Block {
		if err := removeIfExists(target); err != nil {
			return nil, status.Errorf(codes.Internal, "remove %s: %v", target, err)
		}
	}
	if err := d.unmapVolume(ctx, id); err != nil {
		return nil, err
	}
	if err := d.state.remove(id); err != nil {
		return nil, status.Errorf(codes.Internal, "remove stage record: %v", err)
	}
	d.log.Info("unstaged", "volume", id, "from", staging)
	return &csi.NodeUnstageVolumeResponse{}, nil
}

// unmountAll unmounts path until nothing is mounted there (a mount may
// have been stacked by a retried call).
func unmountAll(m mount.Interface, path string) error {
	for range 8 {
		notMnt, err := mount.IsNotMountPoint(m, path)
		if errors.Is(err, os.ErrNotExist) || (err == nil && notMnt) {
			return nil
		}
		if err != nil {
			return err
		}
		if err := m.Unmount(path); err != nil {
			return err
		}
	}
	return fmt.Errorf("%s stays mounted", path)
}

func accessName(block bool) string {
	if block {
		return "block"
	}
	return "mount"
}
