package csi

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
)

// Volumes made from a snapshot (a restore) or from a volume (a PVC
// clone) are format-2 clones. A restore clones the snapshot itself; a
// clone snapshots its source (through the node's quiesce, so a mounted
// filesystem is consistent as of the call), clones that, and removes the
// snapshot at once: librbd keeps it in the trash namespace while the
// clone depends on it. Either way the new volume is one link deeper
// than its source, and the clone-depth limits apply (depth.go).

// volSource is a resolved volume content source.
type volSource struct {
	snapshot *snapshotID // a restore
	volume   *volume     // a clone
	// ref and snapID name where the clone's parent chain starts: the
	// snapshot, or the source volume's head (its temporary snapshot has
	// the same chain).
	ref    ceph.ImageRef
	snapID uint64
	// parent is the image spec to clone, with its snapshot (a restore).
	parent ceph.ImageSpec
	name   string // the source image's name, for logs
	size   uint64
	kind   string // volumeKind of the source, "" if unknown
	// deepFlatten: flattening the source image cuts the chain a clone of
	// it would have (see cloneStep).
	deepFlatten bool
	// meta is the source image's metadata (its encryption), and volID
	// the ID of the volume it is the image of (its key's salt).
	meta  map[string]string
	volID string
}

// id is the source's CSI ID, as metaSource records it ("" for none).
func (s *volSource) id() string {
	switch {
	case s == nil:
		return ""
	case s.snapshot != nil:
		return s.snapshot.String()
	}
	return s.volume.ID()
}

// resolveSource finds a CreateVolume's content source: NotFound if it
// does not exist, InvalidArgument if it is on another cluster or used
// another way than kind.
func (d *Driver) resolveSource(o ceph.Options, clusterID string, c *csi.VolumeContentSource, kind string) (*volSource, error) {
	var src *volSource
	switch {
	case c.GetSnapshot() != nil:
		sid, err := parseSnapshotID(c.GetSnapshot().GetSnapshotId())
		if err != nil {
			return nil, status.Error(codes.NotFound, err.Error())
		}
		if sid.ClusterID != clusterID {
			return nil, status.Errorf(codes.InvalidArgument, "snapshot %s is on cluster %q, the volume would be on %q",
				sid, sid.ClusterID, clusterID)
		}
		s, err := d.cfg.Images.GetSnapshot(o, sid.Image, sid.SnapID)
		if errors.Is(err, ceph.ErrSnapshotNotFound) || errors.Is(err, ceph.ErrImageNotFound) ||
			errors.Is(err, ceph.ErrPoolNotFound) || (err == nil && s.Trash) {
			return nil, status.Errorf(codes.NotFound, "snapshot %s does not exist", sid)
		}
		if err != nil {
			return nil, cephStatus(err, "look up snapshot "+sid.String())
		}
		src = &volSource{snapshot: &sid, ref: sid.Image, snapID: sid.SnapID, size: s.Size, name: s.ImageName,
			parent: ceph.ImageSpec{Pool: sid.Image.Pool, Namespace: sid.Image.Namespace, Image: s.ImageName, Snap: s.Name}}
		info, err := d.cfg.Images.ImageInfo(o, ceph.ImageSpec{Pool: sid.Image.Pool, Namespace: sid.Image.Namespace, Image: s.ImageName})
		if err != nil {
			return nil, cephStatus(err, "look up the image of snapshot "+sid.String())
		}
		src.deepFlatten = info.HasFeature("deep-flatten")
		src.meta, src.size = info.Meta, usableBytes(s.Size, info.Meta)
		src.volID = volume{ClusterID: sid.ClusterID, Spec: ceph.ImageSpec{Pool: sid.Image.Pool,
			Namespace: sid.Image.Namespace, Image: s.ImageName}}.ID()
		j := d.journal(o, sid.Image.Pool, sid.Image.Namespace)
		if name, ok, err := j.getString(snapIDKey(sid)); err == nil && ok {
			var rec snapRecord
			if ok, _ := j.get(snapKey(name), &rec); ok {
				src.kind = rec.Kind
			}
		}
	case c.GetVolume() != nil:
		v, err := parseVolumeID(c.GetVolume().GetVolumeId())
		if err != nil {
			return nil, status.Error(codes.NotFound, err.Error())
		}
		if v.ClusterID != clusterID {
			return nil, status.Errorf(codes.InvalidArgument, "volume %s is on cluster %q, the clone would be on %q",
				v.ID(), v.ClusterID, clusterID)
		}
		info, err := d.cfg.Images.ImageInfo(o, v.Spec)
		if errors.Is(err, ceph.ErrImageNotFound) || errors.Is(err, ceph.ErrPoolNotFound) {
			return nil, status.Errorf(codes.NotFound, "volume %s does not exist", v.ID())
		}
		if err != nil {
			return nil, cephStatus(err, "look up source "+describe(v))
		}
		if !info.HasFeature("layering") {
			return nil, status.Errorf(codes.InvalidArgument, "source volume %s has no layering feature: it cannot be cloned", describe(v))
		}
		src = &volSource{volume: &v, ref: ceph.ImageRef{Pool: v.Spec.Pool, Namespace: v.Spec.Namespace, ID: info.ID},
			size: usableBytes(info.Size, info.Meta), name: v.Spec.Image, kind: info.Meta[metaKind], deepFlatten: true,
			meta: info.Meta, volID: v.ID()}
	default:
		return nil, status.Error(codes.InvalidArgument, "volume content source is neither a snapshot nor a volume")
	}
	if src.kind != "" && kind != "" && src.kind != kind {
		return nil, status.Errorf(codes.InvalidArgument, "the source %s is %s; this volume would be %s",
			src.id(), kindName(src.kind), kindName(kind))
	}
	return src, nil
}

func kindName(k string) string {
	if k == "block" {
		return "a raw block volume"
	}
	return "a " + k[len("fs:"):] + " filesystem"
}

// cloneVolume makes vol from src within the depth limits: Aborted while
// the source must be flattened first, a background flatten of the new
// volume when it is past the soft depth.
func (d *Driver) cloneVolume(o ceph.Options, name string, vol volume, p params, features []string, size uint64,
	src *volSource, kind string, secrets map[string]string) error {
	srcKey, err := d.cloneEncryption(src, p.Encryption, vol.ID(), secrets)
	if err != nil {
		return err
	}
	chain, err := d.cfg.Images.ParentChain(o, src.ref, src.snapID)
	if err != nil {
		return cephStatus(err, "parent chain of "+src.id())
	}
	step := d.cfg.Limits.cloneStep(len(chain), src.deepFlatten)
	if step == flattenParentFirst {
		j := d.journal(o, src.ref.Pool, src.ref.Namespace)
		job, err := d.flat.start(vol.ClusterID, o, j, src.ref, src.name,
			fmt.Sprintf("a clone of it would have %d parents, past the hard depth %d", len(chain)+1, d.cfg.Limits.HardDepth),
			func() { d.collectChain(o, vol.ClusterID, chain) })
		if err != nil {
			return cephStatus(err, "start flatten of "+src.name)
		}
		done, total := job.progress()
		return status.Errorf(codes.Aborted,
			"the source %s has %d parents: a clone would pass the hard depth %d; flattening %s first (%d of %d objects)",
			src.id(), len(chain), d.cfg.Limits.HardDepth, src.name, done, total)
	}
	parent := src.parent
	if src.volume != nil {
		var s ceph.SnapshotOf
		err := d.flat.quiet(vol.ClusterID, src.ref, func() error {
			var err error
			s, err = d.cfg.Images.CreateSnapshot(o, src.volume.Spec, hashName(cloneSnapPrefix, name), ceph.QuiesceRequired)
			return err
		})
		if err != nil {
			return cephStatus(err, "snapshot source "+describe(*src.volume))
		}
		parent = src.volume.Spec
		parent.Snap = s.Name
	}
	if kind == "" {
		kind = src.kind
	}
	if !slices.Contains(features, "layering") {
		features = append(append([]string{}, features...), "layering")
	}
	meta := volumeMeta(name, src.id(), kind, p.Owner)
	maps.Copy(meta, srcKey)
	j := d.journal(o, vol.Spec.Pool, vol.Spec.Namespace)
	if err := j.update(map[string]any{cloneKey(name): cloneRecord{Image: vol.Spec.Image, Parent: parent.String(),
		Since: time.Now().UTC()}}); err != nil {
		if src.volume != nil {
			d.dropCloneSnapshot(o, src.volume.ID(), name)
		}
		return cephStatus(err, "journal the clone "+describe(vol))
	}
	err = d.cfg.Images.CloneImage(o, parent, vol.Spec, ceph.NewImage{Size: imageBytes(size, p.Encryption.On),
		Features: features, DataPool: p.DataPool, Meta: meta})
	if src.volume != nil {
		// Made or not, the clone needs its temporary snapshot no more:
		// a snapshot left behind would keep a deleted source's image.
		d.dropCloneSnapshot(o, src.volume.ID(), name)
	}
	switch {
	case errors.Is(err, ceph.ErrPoolNotFound), errors.Is(err, ceph.ErrImageNotFound) && p.DataPool != "":
		// librbd answers ENOENT for a missing data pool too.
		return status.Errorf(codes.InvalidArgument, "clone %s (pool or dataPool missing?): %v", vol.Spec, err)
	case err != nil:
		return cephStatus(err, "clone "+src.id())
	}
	if rm := notInherited(meta, src.meta); len(rm) > 0 {
		if err := d.cfg.Images.UpdateMetadata(o, vol.Spec, nil, rm); err != nil {
			return cephStatus(err, "finish "+describe(vol))
		}
	}
	d.cloneFinished(j, name)
	d.log.Info("created volume", "name", name, "image", vol.Spec.String(), "size", size, "from", src.id(),
		"depth", len(chain)+1, "encrypted with the key of", srcKey[metaKeyOf])
	if step != cloneThenFlatten && step != flattenCloneFirst {
		return nil
	}
	reason := fmt.Sprintf("clone depth %d is past the soft depth %d", len(chain)+1, d.cfg.Limits.SoftDepth)
	if step == flattenCloneFirst {
		reason = fmt.Sprintf("clone depth %d is past the hard depth %d", len(chain)+1, d.cfg.Limits.HardDepth)
	}
	parents := append([]ceph.Link{{Pool: src.ref.Pool, Namespace: src.ref.Namespace, ImageID: src.ref.ID}}, chain...)
	job, err := d.flattenVolume(o, vol, reason, parents)
	if err != nil || step == cloneThenFlatten {
		return err
	}
	return tooDeep(vol, len(chain)+1, d.cfg.Limits.HardDepth, job)
}

// flattenVolume starts flattening vol's image; parents is its chain, to
// collect once it is cut loose.
func (d *Driver) flattenVolume(o ceph.Options, vol volume, reason string, parents []ceph.Link) (*flattenJob, error) {
	info, err := d.cfg.Images.ImageInfo(o, vol.Spec)
	if err != nil {
		return nil, cephStatus(err, "look up the new volume "+describe(vol))
	}
	ref := ceph.ImageRef{Pool: vol.Spec.Pool, Namespace: vol.Spec.Namespace, ID: info.ID}
	job, err := d.flat.start(vol.ClusterID, o, d.journal(o, vol.Spec.Pool, vol.Spec.Namespace), ref, vol.Spec.Image,
		reason, func() { d.collectChain(o, vol.ClusterID, parents) })
	if err != nil {
		return nil, cephStatus(err, "start flatten of "+describe(vol))
	}
	return job, nil
}

// tooDeep is the answer while a new volume past the hard depth is
// flattened before it is handed out.
func tooDeep(vol volume, depth, hard int, job *flattenJob) error {
	done, total := job.progress()
	return status.Errorf(codes.Aborted, "volume %s has %d parents, past the hard depth %d: flattening it first (%d of %d objects)",
		describe(vol), depth, hard, done, total)
}

// cloneDepthOK is the check a retried CreateVolume of a clone makes: a
// volume still past the hard depth is not handed out; its flatten is
// (re)started and the answer is Aborted.
func (d *Driver) cloneDepthOK(o ceph.Options, vol volume, info ceph.ImageInfo) error {
	ref := ceph.ImageRef{Pool: vol.Spec.Pool, Namespace: vol.Spec.Namespace, ID: info.ID}
	chain, err := d.cfg.Images.ParentChain(o, ref, 0)
	if err != nil {
		return cephStatus(err, "parent chain of "+describe(vol))
	}
	if len(chain) <= d.cfg.Limits.HardDepth {
		return nil
	}
	job, err := d.flattenVolume(o, vol, fmt.Sprintf("clone depth %d is past the hard depth %d", len(chain), d.cfg.Limits.HardDepth), chain)
	if err != nil {
		return err
	}
	return tooDeep(vol, len(chain), d.cfg.Limits.HardDepth, job)
}

// dropCloneSnapshot removes the temporary snapshot a clone of volume
// source was made from, if it is there (it moves to the trash namespace
// while the clone needs it). Failures are only logged: a retried
// CreateVolume, or the garbage collection of the source once it is
// deleted, removes it.
func (d *Driver) dropCloneSnapshot(o ceph.Options, source, name string) {
	v, err := parseVolumeID(source)
	if err != nil {
		return
	}
	info, err := d.cfg.Images.ImageInfo(o, v.Spec)
	if err != nil {
		return // the source is gone: so is the snapshot
	}
	snaps, err := d.cfg.Images.ListSnapshots(o, v.Spec)
	if err != nil {
		d.log.Warn("list the clone source's snapshots", "source", source, "err", err)
		return
	}
	tmp := hashName(cloneSnapPrefix, name)
	ref := ceph.ImageRef{Pool: v.Spec.Pool, Namespace: v.Spec.Namespace, ID: info.ID}
	for _, s := range snaps {
		if s.Name == tmp && !s.Trash {
			if err := d.cfg.Images.RemoveSnapshot(o, ref, s.ID); err != nil && !errors.Is(err, ceph.ErrSnapshotNotFound) {
				d.log.Warn("remove the clone's temporary snapshot", "source", source, "snapshot", tmp, "err", err)
			}
		}
	}
}

// notInherited lists the keys librbd copied from a clone's parent (it
// copies all image metadata, parent) that must not hold for the clone
// unless its own metadata, meta, sets them: that its parent was deleted,
// or sealed a key the clone's KMS does not use.
func notInherited(meta, parent map[string]string) []string {
	var rm []string
	for _, k := range []string{metaGoneFrom, metaDEK, metaDEKSalt, metaEncrypted, metaKMSID, metaKeyOf,
		keyPVCName, keyPVCNamespace, keyPVName} {
		_, ours := meta[k]
		if _, theirs := parent[k]; theirs && !ours {
			rm = append(rm, k)
		}
	}
	return rm
}

// cloneFinished drops name's clone journal entry: its image is a volume
// now. An entry left by a failed removal only lets a later call remove
// an unfinished image at name, which would be ours anyway.
func (d *Driver) cloneFinished(j journal, name string) {
	if err := j.update(nil, cloneKey(name)); err != nil {
		d.log.Warn("drop a finished clone's journal entry", "name", name, "err", err)
	}
}

// cloneUnderWay is how long after its journal entry a clone may still be
// under way in another controller: librbd's clone is a few OSD
// operations, each bounded by the controller's OSD timeout.
const cloneUnderWay = 2 * controllerOSDTimeout

// errRedo: an unfinished image at a volume's name was removed; the call
// makes the volume afresh.
var errRedo = errors.New("unfinished image removed: make the volume again")

// dropUnfinishedClone removes an image at name's volume that is not the
// clone this call would make (no parent, or another one), if the clone
// journal says a clone of name's was under way: librbd creates a clone's
// image before it attaches the parent, so a controller killed in
// between, or a clone whose own clean-up timed out, leaves one with
// none. It never held data: a volume is handed out only once finished.
// Without the entry, the image is someone else's (foreign).
func (d *Driver) dropUnfinishedClone(o ceph.Options, name string, vol volume, info ceph.ImageInfo, foreign error) error {
	var rec cloneRecord
	ok, err := d.journal(o, vol.Spec.Pool, vol.Spec.Namespace).get(cloneKey(name), &rec)
	if err != nil {
		return cephStatus(err, "read the clone journal of pool "+vol.Spec.Pool)
	}
	if !ok || rec.Image != vol.Spec.Image {
		return foreign
	}
	// Another controller (an old pod still running through a rollout)
	// may be making it right now: librbd opens the image, which then
	// has a watcher, only a moment after creating it, so a young entry
	// is left alone too.
	if age := time.Since(rec.Since); info.Watchers > 0 || age < cloneUnderWay {
		return status.Errorf(codes.Aborted, "image %s, a clone of volume %q begun %s ago, may still be under way",
			vol.Spec, name, age.Round(time.Second))
	}
	switch err := d.cfg.Images.RemoveImage(o, vol.Spec); {
	case errors.Is(err, ceph.ErrImageNotFound):
	case errors.Is(err, ceph.ErrImageInUse):
		return status.Errorf(codes.Aborted, "image %s, an unfinished clone of volume %q, is open elsewhere", vol.Spec, name)
	case err != nil:
		return cephStatus(err, "remove the unfinished clone "+describe(vol))
	}
	d.log.Warn("removed an unfinished clone an earlier call left; making it again", "name", name,
		"image", vol.Spec.String(), "parent", rec.Parent, "since", rec.Since)
	return errRedo
}
