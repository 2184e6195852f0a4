package csi

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
)

// metaName is the image metadata key holding the volume's CSI name: a
// retried CreateVolume finds its image by it, and ListVolumes lists the
// images carrying it.
const metaName = "rbd-nbd-go.csi.io/volume-name"

// controllerOSDTimeout bounds each OSD operation of the controller's
// management calls, so a dead OSD fails a call instead of hanging it.
// (The node daemon's data path waits, as krbd does.)
const controllerOSDTimeout = 60 * time.Second

const (
	mib                = 1 << 20
	defaultVolumeBytes = 1 << 30
)

// imageName is the image a CSI name maps to: fixed by the name, so a
// retry after a lost reply finds the same image without a lookup table.
// The metadata records the name, to tell a (practically impossible) hash
// collision from our own image.
func imageName(name string) string {
	h := sha256.Sum256([]byte(name))
	return fmt.Sprintf("csi-vol-%x-%x-%x-%x-%x", h[0:4], h[4:6], h[6:8], h[8:10], h[10:16])
}

// volumeSize picks the size for a capacity range: whole MiB, at least
// the required bytes, at most the limit.
func volumeSize(r *csi.CapacityRange) (uint64, error) {
	req, lim := r.GetRequiredBytes(), r.GetLimitBytes()
	if req < 0 || lim < 0 {
		return 0, status.Error(codes.InvalidArgument, "capacity range cannot be negative")
	}
	if req == 0 {
		req = defaultVolumeBytes
		if lim > 0 && lim < req {
			req = lim
		}
	}
	size := (uint64(req) + mib - 1) / mib * mib
	if lim > 0 && size > uint64(lim) {
		return 0, status.Errorf(codes.OutOfRange,
			"%d bytes rounded up to whole MiB (%d) exceed the limit of %d bytes", req, size, lim)
	}
	return size, nil
}

func (d *Driver) CreateVolume(ctx context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	accs, err := validateCreateVolumeRequest(req)
	if err != nil {
		return nil, err
	}
	name := req.GetName()
	if req.GetVolumeContentSource() != nil {
		return nil, status.Error(codes.InvalidArgument, "volumes from snapshots or clones are not supported")
	}
	p, err := parseParams(req.GetParameters(), d.mapDefaults())
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	size, err := volumeSize(req.GetCapacityRange())
	if err != nil {
		return nil, err
	}
	creds, err := credentialsFrom(req.GetSecrets())
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	cl, err := d.clusters.get(p.ClusterID)
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	release, err := d.locks.acquire("name/" + name)
	if err != nil {
		return nil, err
	}
	defer release()
	o := cl.options(creds, controllerOSDTimeout)
	vol := volume{ClusterID: p.ClusterID, Spec: ceph.ImageSpec{Pool: p.Pool,
		Namespace: cl.RBD.RadosNamespace, Image: imageName(name)}}
	features := p.Features
	if needsExclusive(accs) && !slices.Contains(features, "exclusive-lock") {
		features = append(append([]string{}, features...), "exclusive-lock")
	}
	info, err := d.cfg.Images.ImageInfo(o, vol.Spec)
	switch {
	case err == nil:
		if n := info.Meta[metaName]; n != "" && n != name {
			return nil, status.Errorf(codes.AlreadyExists, "image %s belongs to volume %q", vol.Spec, n)
		}
		lim := req.GetCapacityRange().GetLimitBytes()
		if info.Size < uint64(req.GetCapacityRange().GetRequiredBytes()) || (lim > 0 && info.Size > uint64(lim)) {
			return nil, status.Errorf(codes.AlreadyExists,
				"volume %q exists with %d bytes, outside the requested range", name, info.Size)
		}
		size = info.Size
		d.log.Info("volume exists", "name", name, "image", vol.Spec.String())
	case errors.Is(err, ceph.ErrPoolNotFound):
		return nil, status.Errorf(codes.InvalidArgument, "parameter %q: %v", "pool", err)
	case errors.Is(err, ceph.ErrImageNotFound):
		err = d.cfg.Images.CreateImage(o, vol.Spec, ceph.NewImage{Size: size, Features: features,
			DataPool: p.DataPool, Meta: map[string]string{metaName: name}})
		if errors.Is(err, ceph.ErrPoolNotFound) || errors.Is(err, ceph.ErrImageNotFound) {
			// A missing data pool reads as ENOENT from librbd.
			return nil, status.Errorf(codes.InvalidArgument, "create %s (pool or dataPool missing?): %v", vol.Spec, err)
		}
		if err != nil {
			return nil, cephStatus(err, "create image")
		}
		d.log.Info("created volume", "name", name, "image", vol.Spec.String(), "size", size)
	default:
		return nil, cephStatus(err, "look up image")
	}
	d.remember(vol, creds)
	return &csi.CreateVolumeResponse{Volume: &csi.Volume{VolumeId: vol.ID(), CapacityBytes: int64(size),
		VolumeContext: volumeContext(p, vol)}}, nil
}

// volumeContext is what NodeStage needs of the StorageClass; it gets no
// parameters of its own.
func volumeContext(p params, vol volume) map[string]string {
	c := map[string]string{"clusterID": p.ClusterID, "pool": vol.Spec.Pool, "imageName": vol.Spec.Image}
	if vol.Spec.Namespace != "" {
		c["radosNamespace"] = vol.Spec.Namespace
	}
	if p.MkfsOptions != "" {
		c["mkfsOptions"] = p.MkfsOptions
	}
	if p.MapOptions != "" {
		c["mapOptions"] = "nbd:" + p.MapOptions
	}
	return c
}

func needsExclusive(accs []access) bool {
	for _, a := range accs {
		if a.Exclusive {
			return true
		}
	}
	return false
}

func (d *Driver) DeleteVolume(ctx context.Context, req *csi.DeleteVolumeRequest) (*csi.DeleteVolumeResponse, error) {
	if err := validateDeleteVolumeRequest(req); err != nil {
		return nil, err
	}
	id := req.GetVolumeId()
	vol, err := parseVolumeID(id)
	if err != nil {
		// Not ours, so nothing to delete: success, as the spec asks.
		d.log.Info("delete of a volume ID that is not ours", "id", id)
		return &csi.DeleteVolumeResponse{}, nil
	}
	creds, err := credentialsFrom(req.GetSecrets())
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	cl, err := d.clusters.get(vol.ClusterID)
	if err != nil {
		// Not "success": the image may well exist on a cluster missing
		// from the config, and would be leaked forever.
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	release, err := d.locks.acquire(id)
	if err != nil {
		return nil, err
	}
	defer release()
	err = d.cfg.Images.RemoveImage(cl.options(creds, controllerOSDTimeout), vol.Spec)
	switch {
	case err == nil:
		d.log.Info("deleted volume", "image", vol.Spec.String())
	case errors.Is(err, ceph.ErrImageNotFound), errors.Is(err, ceph.ErrPoolNotFound):
	case errors.Is(err, ceph.ErrImageInUse):
		return nil, status.Errorf(codes.FailedPrecondition, "volume %s is still mapped: %v", describe(vol), err)
	default:
		return nil, cephStatus(err, "delete "+describe(vol))
	}
	d.remember(vol, creds)
	return &csi.DeleteVolumeResponse{}, nil
}

func (d *Driver) ControllerExpandVolume(ctx context.Context, req *csi.ControllerExpandVolumeRequest) (*csi.ControllerExpandVolumeResponse, error) {
	a, err := validateControllerExpandVolumeRequest(req)
	if err != nil {
		return nil, err
	}
	id, block := req.GetVolumeId(), a.Block
	size, err := volumeSize(req.GetCapacityRange())
	if err != nil {
		return nil, err
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
	if err != nil {
		return nil, cephStatus(err, "look up "+describe(vol))
	}
	if info.Size < size {
		if err := d.cfg.Images.ResizeImage(o, vol.Spec, size); err != nil {
			return nil, cephStatus(err, "resize "+describe(vol))
		}
		d.log.Info("expanded volume", "image", vol.Spec.String(), "from", info.Size, "to", size)
	} else {
		size = info.Size
	}
	return &csi.ControllerExpandVolumeResponse{CapacityBytes: int64(size), NodeExpansionRequired: !block}, nil
}

// volumeAccess decodes a volume ID and finds credentials for it: the
// request's secrets, else the controller's Secret, else (for reads only)
// the last ones seen for its cluster. Errors are gRPC statuses: a
// malformed ID or unknown cluster is NotFound (no such volume can
// exist).
func (d *Driver) volumeAccess(id string, secrets map[string]string, write bool) (volume, ceph.Options, error) {
	vol, err := parseVolumeID(id)
	if err != nil {
		return vol, ceph.Options{}, status.Error(codes.NotFound, err.Error())
	}
	cl, err := d.clusters.get(vol.ClusterID)
	if err != nil {
		return vol, ceph.Options{}, status.Errorf(codes.NotFound, "volume %s: %v", id, err)
	}
	creds, err := credentialsFrom(secrets)
	if err != nil {
		var ok bool
		if write {
			creds, ok = d.secretCreds()
		} else {
			creds, ok = d.knownCreds(vol.ClusterID)
		}
		if !ok {
			return vol, ceph.Options{}, status.Errorf(codes.InvalidArgument,
				"%v, and none have been seen for cluster %q yet", err, vol.ClusterID)
		}
	}
	return vol, cl.options(creds, controllerOSDTimeout), nil
}
