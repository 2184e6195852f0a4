package csi

import (
	"context"
	"errors"
	"maps"
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

// Image metadata the controller writes besides metaName.
const (
	// metaSource is the snapshot or volume ID a volume was made from:
	// a retried CreateVolume with another source is AlreadyExists.
	metaSource = "rbd-nbd-go.csi.io/source"
	// metaKind is how the volume is used (volumeKind): a restore or
	// clone must be used the same way.
	metaKind = "rbd-nbd-go.csi.io/kind"
	// metaGoneFrom is the volume ID a kept image had (csi-gone-ID).
	metaGoneFrom = "rbd-nbd-go.csi.io/deleted-volume"
)

// imageName is the image a CSI name maps to: fixed by the name, so a
// retry after a lost reply finds the same image without a lookup table.
// The metadata records the name, to tell a (practically impossible) hash
// collision from our own image.
func imageName(name string) string { return hashName("csi-vol-", name) }

// volumeSize picks the size for a capacity range: whole MiB, at least
// the required bytes, at most the limit; without required bytes, 1 GiB,
// or for a volume made from a snapshot or volume, its source's size
// (min), which it can never be smaller than.
func volumeSize(r *csi.CapacityRange, min uint64) (uint64, error) {
	req, lim := r.GetRequiredBytes(), r.GetLimitBytes()
	if req < 0 || lim < 0 {
		return 0, status.Error(codes.InvalidArgument, "capacity range cannot be negative")
	}
	if min > 0 && lim > 0 && uint64(lim) < min {
		return 0, status.Errorf(codes.OutOfRange, "the limit of %d bytes is below the source's %d bytes", lim, min)
	}
	if min > 0 && req > 0 && uint64(req) < min {
		return 0, status.Errorf(codes.OutOfRange, "%d bytes asked for, but the source has %d", req, min)
	}
	if req == 0 {
		req = defaultVolumeBytes
		if min > 0 {
			return min, nil
		}
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

// volumeKind is how a volume's capabilities use it, "block" or "fs:TYPE",
// or "" when they mix.
func volumeKind(accs []access) string {
	kind := ""
	for i, a := range accs {
		k := "block"
		if !a.Block {
			k = "fs:" + a.FsType
		}
		if i > 0 && k != kind {
			return ""
		}
		kind = k
	}
	return kind
}

func (d *Driver) CreateVolume(ctx context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	accs, err := validateCreateVolumeRequest(req)
	if err != nil {
		return nil, err
	}
	name := req.GetName()
	p, err := parseParams(req.GetParameters(), d.mapDefaults())
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	if p.QoS, err = createQoS(p.QoS, req.GetMutableParameters()); err != nil {
		return nil, err
	}
	if _, err := volumeSize(req.GetCapacityRange(), 0); err != nil {
		return nil, err
	}
	if p.Encryption.On {
		// A bad KMS ID or Secret fails before anything is made.
		if _, err := keyManagerFor(d.cfg.KMSConfig, p.Encryption.KMSID, req.GetSecrets()); err != nil {
			return nil, err
		}
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
	o := cl.options(creds, controllerOSDTimeout)
	vol := volume{ClusterID: p.ClusterID, Spec: ceph.ImageSpec{Pool: p.Pool,
		Namespace: cl.RBD.RadosNamespace, Image: imageName(name)}}
	// A clone's snapshot waits for the node to freeze its filesystem,
	// which librbd cannot interrupt: it holds the name until it ends.
	return detach(ctx, release, func() (*csi.CreateVolumeResponse, error) {
		v, err := d.createVolume(o, name, vol, p, accs, req.GetCapacityRange(), req.GetVolumeContentSource(), req.GetSecrets())
		if err == nil {
			err = d.applyQoS(o, vol, p.QoS, v)
		}
		if err != nil {
			return nil, err
		}
		d.remember(vol, creds)
		return &csi.CreateVolumeResponse{Volume: v}, nil
	})
}

func (d *Driver) createVolume(o ceph.Options, name string, vol volume, p params, accs []access,
	cr *csi.CapacityRange, content *csi.VolumeContentSource, secrets map[string]string) (*csi.Volume, error) {
	wantSrc, err := contentID(content)
	if err != nil {
		return nil, err
	}
	info, err := d.cfg.Images.ImageInfo(o, vol.Spec)
	if err == nil {
		// A retry: answered from the image, even if its source has
		// gone since (a lost reply must not turn into NotFound).
		size, xerr := d.existingVolume(o, name, vol, p, accs, cr, content, wantSrc, info, secrets)
		if !errors.Is(xerr, errRedo) {
			if xerr != nil {
				return nil, xerr
			}
			return &csi.Volume{VolumeId: vol.ID(), CapacityBytes: int64(size), VolumeContext: volumeContext(p, vol),
				ContentSource: content}, nil
		}
		err = ceph.ErrImageNotFound // removed: made below
	}
	switch {
	case errors.Is(err, ceph.ErrPoolNotFound):
		return nil, status.Errorf(codes.InvalidArgument, "parameter %q: %v", "pool", err)
	case !errors.Is(err, ceph.ErrImageNotFound):
		return nil, cephStatus(err, "look up image")
	}
	features := p.Features
	if needsExclusive(accs) && !slices.Contains(features, "exclusive-lock") {
		features = append(append([]string{}, features...), "exclusive-lock")
	}
	var src *volSource
	var min uint64
	if content != nil {
		if src, err = d.resolveSource(o, vol.ClusterID, content, volumeKind(accs)); err != nil {
			return nil, err
		}
		min = src.size
	}
	size, err := volumeSize(cr, min)
	if err != nil {
		return nil, err
	}
	if src != nil {
		if err := d.cloneVolume(o, name, vol, p, features, size, src, volumeKind(accs), secrets); err != nil {
			return nil, err
		}
	} else {
		meta := volumeMeta(name, "", volumeKind(accs), p.Owner)
		var pass []byte
		if p.Encryption.On {
			var em map[string]string
			if pass, em, err = d.newEncryptionMeta(p.Encryption, vol.ID(), secrets); err != nil {
				return nil, err
			}
			defer clear(pass)
			maps.Copy(meta, em)
		}
		err = d.cfg.Images.CreateImage(o, vol.Spec, ceph.NewImage{Size: imageBytes(size, p.Encryption.On),
			Features: features, DataPool: p.DataPool, Meta: meta})
		if errors.Is(err, ceph.ErrPoolNotFound) || errors.Is(err, ceph.ErrImageNotFound) {
			// A missing data pool reads as ENOENT from librbd.
			return nil, status.Errorf(codes.InvalidArgument, "create %s (pool or dataPool missing?): %v", vol.Spec, err)
		}
		if err != nil {
			return nil, cephStatus(err, "create image")
		}
		if p.Encryption.On {
			if err := d.formatPrepared(o, vol, pass); err != nil {
				// Nothing half made: the image holds nothing yet.
				if rerr := d.cfg.Images.RemoveImage(o, vol.Spec); rerr != nil {
					d.log.Warn("remove the image of a volume whose LUKS format failed", "image", vol.Spec.String(), "err", rerr)
				}
				return nil, err
			}
		}
		d.log.Info("created volume", "name", name, "image", vol.Spec.String(), "size", size, "encrypted", p.Encryption.On)
	}
	return &csi.Volume{VolumeId: vol.ID(), CapacityBytes: int64(size), VolumeContext: volumeContext(p, vol),
		ContentSource: content}, nil
}

// contentID is a content source's ID as metaSource records it: "" for
// none, NotFound for an ID that is not ours.
func contentID(c *csi.VolumeContentSource) (string, error) {
	switch {
	case c == nil:
		return "", nil
	case c.GetSnapshot() != nil:
		sid, err := parseSnapshotID(c.GetSnapshot().GetSnapshotId())
		if err != nil {
			return "", status.Error(codes.NotFound, err.Error())
		}
		return sid.String(), nil
	case c.GetVolume() != nil:
		v, err := parseVolumeID(c.GetVolume().GetVolumeId())
		if err != nil {
			return "", status.Error(codes.NotFound, err.Error())
		}
		return v.ID(), nil
	}
	return "", status.Error(codes.InvalidArgument, "volume content source is neither a snapshot nor a volume")
}

// existingVolume answers a CreateVolume whose image exists: the same
// volume (a retry) or a conflict. An image the first call made but did
// not finish (a controller killed between the clone or create and its
// metadata) is finished, if it is what this call would have made.
func (d *Driver) existingVolume(o ceph.Options, name string, vol volume, p params, accs []access,
	cr *csi.CapacityRange, content *csi.VolumeContentSource, wantSrc string, info ceph.ImageInfo,
	secrets map[string]string) (uint64, error) {
	n := info.Meta[metaName]
	if n != "" && n != name && imageName(n) == vol.Spec.Image {
		return 0, status.Errorf(codes.AlreadyExists, "image %s belongs to volume %q", vol.Spec, n)
	}
	// A name that is not this image's own came with its parent's
	// metadata, which librbd copies into a clone: the clone's creator
	// died before writing ours over it.
	if n == "" || imageName(n) != vol.Spec.Image {
		var err error
		if info, err = d.adopt(o, name, vol, p, accs, cr, content, wantSrc, info, secrets); err != nil {
			return 0, err
		}
	}
	if isEncrypted(info.Meta) != p.Encryption.On {
		return 0, status.Errorf(codes.AlreadyExists, "volume %q exists, encrypted %v, not %v",
			name, isEncrypted(info.Meta), p.Encryption.On)
	}
	if info.Meta[metaEncrypted] == statePrepared {
		// Its creator died between the key and the header.
		pass, err := d.volumeKey(info.Meta[metaKMSID], vol.ID(), info.Meta, nil, secrets)
		if err != nil {
			return 0, err
		}
		err = d.formatPrepared(o, vol, pass)
		clear(pass)
		if err != nil {
			return 0, err
		}
		info.Meta[metaEncrypted] = stateEncrypted
	}
	size := usableBytes(info.Size, info.Meta)
	if got := info.Meta[metaSource]; got != wantSrc {
		return 0, status.Errorf(codes.AlreadyExists, "volume %q exists, made from %q, not %q", name, got, wantSrc)
	}
	lim := cr.GetLimitBytes()
	if size < uint64(cr.GetRequiredBytes()) || (lim > 0 && size > uint64(lim)) {
		return 0, status.Errorf(codes.AlreadyExists,
			"volume %q exists with %d bytes, outside the requested range", name, size)
	}
	if wantSrc != "" {
		if err := d.cloneDepthOK(o, vol, info); err != nil {
			return 0, err
		}
		if v := content.GetVolume(); v != nil {
			d.dropCloneSnapshot(o, v.GetVolumeId(), name)
		}
		// Finished, but its maker may have died before it said so.
		d.cloneFinished(d.journal(o, vol.Spec.Pool, vol.Spec.Namespace), name)
	}
	d.log.Info("volume exists", "name", name, "image", vol.Spec.String())
	return size, nil
}

// adopt finishes an image at a volume's name that has no volume name in
// its metadata: made by this driver's earlier call for it, which died
// before the metadata (and, for a clone, before growing it). It is ours
// only if it is what this call would make: a plain image for no source,
// a clone of the source's image for a source. Anything else is someone
// else's image: AlreadyExists.
func (d *Driver) adopt(o ceph.Options, name string, vol volume, p params, accs []access, cr *csi.CapacityRange,
	content *csi.VolumeContentSource, wantSrc string, info ceph.ImageInfo, secrets map[string]string) (ceph.ImageInfo, error) {
	foreign := status.Errorf(codes.AlreadyExists, "image %s exists and is not volume %q's", vol.Spec, name)
	var srcKey map[string]string // a clone's copy of its source's key
	var src *volSource
	if wantSrc == "" && info.Parent != nil {
		return info, foreign
	}
	if wantSrc != "" {
		var err error
		if src, err = d.resolveSource(o, vol.ClusterID, content, volumeKind(accs)); err != nil {
			return info, err
		}
		if info.Parent == nil || info.Parent.ImageID != src.ref.ID || info.Parent.Pool != src.ref.Pool {
			return info, d.dropUnfinishedClone(o, name, vol, info, foreign)
		}
		size, err := volumeSize(cr, src.size)
		if err != nil {
			return info, err
		}
		size = imageBytes(size, isEncrypted(src.meta))
		if info.Size < size {
			if err := d.cfg.Images.ResizeImage(o, vol.Spec, size); err != nil {
				return info, cephStatus(err, "grow "+describe(vol))
			}
			info.Size = size
		}
		if srcKey, err = d.cloneEncryption(src, p.Encryption, vol.ID(), secrets); err != nil {
			return info, err
		}
	}
	meta := volumeMeta(name, wantSrc, volumeKind(accs), p.Owner)
	maps.Copy(meta, srcKey)
	var rm []string
	if src != nil {
		rm = notInherited(meta, src.meta)
	}
	if p.Encryption.On && wantSrc == "" && !isEncrypted(info.Meta) {
		// Made before its key was: make one (the header comes next).
		pass, em, err := d.newEncryptionMeta(p.Encryption, vol.ID(), secrets)
		if err != nil {
			return info, err
		}
		clear(pass)
		maps.Copy(meta, em)
	}
	if err := d.cfg.Images.UpdateMetadata(o, vol.Spec, meta, rm); err != nil {
		return info, cephStatus(err, "finish "+describe(vol))
	}
	if src != nil {
		d.cloneFinished(d.journal(o, vol.Spec.Pool, vol.Spec.Namespace), name)
	}
	if info.Meta == nil {
		info.Meta = map[string]string{}
	}
	for k, v := range meta {
		info.Meta[k] = v
	}
	d.log.Info("finished a volume an earlier call left half made", "name", name, "image", vol.Spec.String())
	return info, nil
}

func needsExclusive(accs []access) bool {
	for _, a := range accs {
		if a.Exclusive {
			return true
		}
	}
	return false
}

// DeleteVolume removes the volume's image; one with snapshots (or
// snapshots kept for clones) is renamed csi-gone-ID instead, and removed
// with the last of them. Unknown volumes succeed, as the spec asks.
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
	o := cl.options(creds, controllerOSDTimeout)
	info, err := d.cfg.Images.ImageInfo(o, vol.Spec)
	switch {
	case errors.Is(err, ceph.ErrImageNotFound), errors.Is(err, ceph.ErrPoolNotFound):
		return &csi.DeleteVolumeResponse{}, nil
	case err != nil:
		return nil, cephStatus(err, "look up "+describe(vol))
	}
	ref := ceph.ImageRef{Pool: vol.Spec.Pool, Namespace: vol.Spec.Namespace, ID: info.ID}
	// A background flatten holds the image open: stop it (it stays owed
	// if the image is kept).
	d.flat.cancel(vol.ClusterID, ref)
	j := d.journal(o, vol.Spec.Pool, vol.Spec.Namespace)
	err = d.cfg.Images.RemoveImage(o, vol.Spec)
	switch {
	case err == nil:
		d.log.Info("deleted volume", "image", vol.Spec.String())
		if err := j.update(nil, flattenKey(ref)); err != nil {
			d.log.Warn("clear the deleted volume's journal entries", "err", err)
		}
		if info.Parent != nil {
			d.collectGone(o, vol.ClusterID, info.Parent.Ref())
		}
	case errors.Is(err, ceph.ErrImageNotFound), errors.Is(err, ceph.ErrPoolNotFound):
	case errors.Is(err, ceph.ErrHasSnapshots):
		if err := d.keepGone(o, j, vol, info); err != nil {
			return nil, err
		}
		// Snapshots only a failed call left do not keep it.
		d.collectGone(o, vol.ClusterID, ceph.ImageRef{Pool: vol.Spec.Pool, Namespace: vol.Spec.Namespace, ID: info.ID})
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
	size, err := volumeSize(req.GetCapacityRange(), 0)
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
	// An encrypted image is larger than its volume by the LUKS header;
	// librbd shows the mapped device the rest, so it grows online.
	if cur := usableBytes(info.Size, info.Meta); cur < size {
		if err := d.cfg.Images.ResizeImage(o, vol.Spec, imageBytes(size, isEncrypted(info.Meta))); err != nil {
			return nil, cephStatus(err, "resize "+describe(vol))
		}
		d.log.Info("expanded volume", "image", vol.Spec.String(), "from", cur, "to", size)
	} else {
		size = cur
	}
	if err := d.resizeQoS(o, vol, info.Meta, size); err != nil {
		return nil, err
	}
	return &csi.ControllerExpandVolumeResponse{CapacityBytes: int64(size), NodeExpansionRequired: !block}, nil
}

// volumeAccess decodes a volume ID and finds credentials for it (see
// clusterAccess). A malformed ID or unknown cluster is NotFound: no such
// volume can exist.
func (d *Driver) volumeAccess(id string, secrets map[string]string, write bool) (volume, ceph.Options, error) {
	vol, err := parseVolumeID(id)
	if err != nil {
		return vol, ceph.Options{}, status.Error(codes.NotFound, err.Error())
	}
	o, err := d.clusterAccess(vol.ClusterID, secrets, write)
	if status.Code(err) == codes.NotFound {
		return vol, o, status.Errorf(codes.NotFound, "volume %s: %v", id, status.Convert(err).Message())
	}
	return vol, o, err
}

// clusterAccess finds credentials for a cluster: the request's secrets,
// else the controller's Secret, else (for reads only) the last ones seen
// for the cluster. An unknown cluster is NotFound; no credentials at all
// InvalidArgument.
func (d *Driver) clusterAccess(clusterID string, secrets map[string]string, write bool) (ceph.Options, error) {
	cl, err := d.clusters.get(clusterID)
	if err != nil {
		return ceph.Options{}, status.Error(codes.NotFound, err.Error())
	}
	creds, err := credentialsFrom(secrets)
	if err != nil {
		var ok bool
		if write {
			creds, ok = d.secretCreds()
		} else {
			creds, ok = d.knownCreds(clusterID)
		}
		if !ok {
			return ceph.Options{}, status.Errorf(codes.InvalidArgument,
				"%v, and none have been seen for cluster %q yet", err, clusterID)
		}
	}
	return cl.options(creds, controllerOSDTimeout), nil
}

// writeCreds says whether a call's credentials may write: its own
// secrets, or the controller's Secret.
func (d *Driver) writeCreds(secrets map[string]string) bool {
	if _, err := credentialsFrom(secrets); err == nil {
		return true
	}
	_, ok := d.secretCreds()
	return ok
}

// detach runs fn, the rest of a call, so that it may outlast the call:
// librbd's calls cannot be interrupted. If ctx ends first the call
// answers its error and fn goes on; release runs when fn ends, so a
// retry meanwhile gets Aborted instead of a second librbd call. A panic
// in fn becomes Internal, as the interceptor does for the call itself.
func detach[T any](ctx context.Context, release func(), fn func() (T, error)) (T, error) {
	type result struct {
		v   T
		err error
	}
	ch := make(chan result, 1)
	go func() {
		var r result
		defer func() {
			if p := recover(); p != nil {
				r.err = status.Errorf(codes.Internal, "internal error: %v", p)
			}
			// Released before the answer: a caller that gets it may call
			// again at once.
			release()
			ch <- r
		}()
		r.v, r.err = fn()
	}()
	select {
	case r := <-ch:
		return r.v, r.err
	case <-ctx.Done():
		var zero T
		return zero, status.FromContextError(ctx.Err()).Err()
	}
}
