package csi

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
)

// Deleted volumes whose images something still needs, and the sweep
// that removes them once nothing does, with no ceph-mgr task: the
// controller does it itself, right after each delete that may have
// freed one, and every SweepInterval for what those missed (a clone
// deleted by hand, a controller restarted mid-way).

// keepGone deletes a volume whose image has snapshots, or snapshots
// kept for clones: the image is journalled, then renamed csi-gone-ID
// (its name is free for a new volume of the same CSI name at once) and
// loses its volume name, so ListVolumes no longer shows it. Journal
// first: a controller that dies between the two finds the entry, and
// the retried DeleteVolume does the rename.
func (d *Driver) keepGone(o ceph.Options, j journal, vol volume, info ceph.ImageInfo) error {
	hidden := goneName(info.ID)
	rec := goneRecord{Name: hidden, Volume: vol.ID(), Since: time.Now().UTC()}
	if err := j.update(map[string]any{goneKey(info.ID): rec}); err != nil {
		return cephStatus(err, "journal the deleted volume "+describe(vol))
	}
	// Unmarked before the rename: a retry after a failed rename finds
	// the image still at its name and renames it; the other way round, a
	// failed unmarking would leave a kept image that lists as a volume.
	if err := d.cfg.Images.UpdateMetadata(o, vol.Spec, map[string]string{metaGoneFrom: vol.ID()}, []string{metaName}); err != nil {
		return cephStatus(err, "mark the deleted volume "+describe(vol))
	}
	if err := d.cfg.Images.RenameImage(o, vol.Spec, hidden); err != nil {
		return cephStatus(err, "rename the deleted volume "+describe(vol))
	}
	spec := vol.Spec
	spec.Image = hidden
	d.log.Info("deleted volume; its image stays for its snapshots or clones", "volume", vol.ID(), "image", spec.String())
	return nil
}

// collectGone removes the kept image of a deleted volume (ref) if
// nothing needs it any more: no snapshot left, not even one kept in the
// trash namespace for a clone. Then its own parent may be free too.
// Failures are logged: the sweep tries again.
func (d *Driver) collectGone(o ceph.Options, cluster string, ref ceph.ImageRef) {
	for range maxCollect {
		parent, err := d.collectOne(o, cluster, ref)
		if err != nil {
			d.log.Warn("remove a deleted volume's image", "id", ref.String(), "err", err)
			return
		}
		if parent == nil {
			return
		}
		ref = *parent
	}
}

// maxCollect bounds a collect's walk up a chain (a chain is at most the
// hard depth, plus what older controllers left).
const maxCollect = 64

// collectOne removes ref's image if it is a kept one nothing needs, and
// returns its parent if it removed it.
func (d *Driver) collectOne(o ceph.Options, cluster string, ref ceph.ImageRef) (*ceph.ImageRef, error) {
	j := d.journal(o, ref.Pool, ref.Namespace)
	var g goneRecord
	ok, err := j.get(goneKey(ref.ID), &g)
	if err != nil || !ok {
		return nil, err
	}
	name, err := d.cfg.Images.ImageName(o, ref)
	switch {
	case errors.Is(err, ceph.ErrImageNotFound):
		return nil, j.update(nil, goneKey(ref.ID), flattenKey(ref))
	case err != nil:
		return nil, err
	case name != g.Name:
		return nil, nil // not renamed yet: the retried DeleteVolume does it
	}
	spec := ceph.ImageSpec{Pool: ref.Pool, Namespace: ref.Namespace, Image: name}
	snaps, err := d.cfg.Images.ListSnapshots(o, spec)
	if err != nil {
		return nil, err
	}
	if left, err := d.dropOrphans(o, j, ref, snaps); err != nil || left > 0 {
		return nil, err
	}
	info, err := d.cfg.Images.ImageInfo(o, spec)
	if err != nil {
		return nil, err
	}
	d.flat.cancel(cluster, ref)
	err = d.cfg.Images.RemoveImage(o, spec)
	switch {
	case errors.Is(err, ceph.ErrHasSnapshots), errors.Is(err, ceph.ErrImageInUse):
		return nil, nil // taken again meanwhile, or still open: later
	case err != nil && !errors.Is(err, ceph.ErrImageNotFound):
		return nil, err
	}
	if err := j.update(nil, goneKey(ref.ID), flattenKey(ref)); err != nil {
		return nil, err
	}
	d.log.Info("removed a deleted volume's image: no snapshot or clone needs it any more", "image", spec.String(),
		"volume", g.Volume)
	if info.Parent == nil {
		return nil, nil
	}
	p := info.Parent.Ref()
	return &p, nil
}

// dropOrphans removes the snapshots of a kept image that no CSI call
// can reach any more and returns how many are left: a clone's temporary
// snapshot a failed clone left, and a VolumeSnapshot's RBD snapshot whose
// ID was never journalled (nor returned: the journal is written before
// the reply), and a snapshot in the trash namespace no clone needs any
// more. Other trashed snapshots stay until their clones go; one removed
// here that clones need moves there. Snapshots not
// named by this driver (an admin's) are left, and keep the image.
func (d *Driver) dropOrphans(o ceph.Options, j journal, ref ceph.ImageRef, snaps []ceph.Snapshot) (int, error) {
	left := 0
	for _, s := range snaps {
		orphan := false
		switch {
		case s.Trash:
			// librbd removes a trashed snapshot with its last clone's
			// link, but only tries once and ignores a failure: one
			// left with no clones would keep the image for good.
			kids, err := d.cfg.Images.Children(o, ref, s.ID)
			if err != nil && !errors.Is(err, ceph.ErrSnapshotNotFound) {
				return 0, err
			}
			orphan = err == nil && len(kids) == 0
		case strings.HasPrefix(s.Name, cloneSnapPrefix):
			orphan = true
		case hashedName.MatchString(s.Name):
			_, journalled, err := j.getString(snapIDKey(snapshotID{Image: ref, SnapID: s.ID}))
			if err != nil {
				return 0, err
			}
			orphan = !journalled
		}
		if !orphan {
			left++
			continue
		}
		err := d.cfg.Images.RemoveSnapshot(o, ref, s.ID)
		if err != nil && !errors.Is(err, ceph.ErrSnapshotNotFound) {
			return 0, err
		}
		d.log.Info("removed an orphaned snapshot of a deleted volume's image", "id", ref.String(), "snapshot", s.Name)
		left++ // it may have moved to the trash namespace: look again
	}
	if left == 0 {
		return 0, nil
	}
	name, err := d.cfg.Images.ImageName(o, ref)
	if err != nil {
		return 0, err
	}
	snaps, err = d.cfg.Images.ListSnapshots(o, ceph.ImageSpec{Pool: ref.Pool, Namespace: ref.Namespace, Image: name})
	return len(snaps), err
}

// hashedName matches the names hashName gives.
var hashedName = regexp.MustCompile(`[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)

// collectChain collects from the first link of a chain up, after a
// flatten cut a clone loose from it.
func (d *Driver) collectChain(o ceph.Options, cluster string, chain []ceph.Link) {
	if len(chain) > 0 {
		d.collectGone(o, cluster, chain[0].Ref())
	}
}

// flattenTrashed starts flattening every clone of ref's trashed
// snapshots, so those snapshots go (librbd removes a trashed snapshot
// with its last clone's link).
func (d *Driver) flattenTrashed(o ceph.Options, cluster string, ref ceph.ImageRef, name string, snaps []ceph.Snapshot) {
	for _, s := range snaps {
		if !s.Trash {
			continue
		}
		kids, err := d.cfg.Images.Children(o, ref, s.ID)
		if err != nil {
			d.log.Warn("list clones of a trashed snapshot", "image", name, "snapshot", s.ID, "err", err)
			continue
		}
		for _, k := range kids {
			kref := ceph.ImageRef{Pool: k.Pool, Namespace: k.Namespace, ID: k.ID}
			_, err := d.flat.start(cluster, o, d.journal(o, k.Pool, k.Namespace), kref, k.Image,
				fmt.Sprintf("%s has many snapshots; this clone holds its trashed snapshot %d", name, s.ID),
				func() { d.collectGone(o, cluster, ref) })
			if err != nil {
				d.log.Warn("start a flatten", "image", k.Image, "err", err)
			}
		}
	}
}

// sweep runs until ctx ends: at once, then every SweepInterval.
func (d *Driver) sweep(ctx context.Context) {
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		d.sweepOnce()
		t.Reset(d.cfg.SweepInterval)
	}
}

// sweepOnce resumes owed flattens and removes kept images nothing needs,
// in every pool of every configured cluster. It writes, so it uses only
// the controller's own Secret; without one, the deletes that free an
// image remove it, and owed flattens wait for the CreateVolume retries
// that need them.
func (d *Driver) sweepOnce() {
	creds, ok := d.secretCreds()
	if !ok {
		return
	}
	cs, err := d.clusters.load()
	if err != nil {
		d.log.Warn("sweep: clusters config", "err", err)
		return
	}
	for _, cl := range cs {
		if len(cl.Monitors) == 0 {
			continue
		}
		o := cl.options(creds, controllerOSDTimeout)
		pools, err := d.cfg.Images.ListPools(o)
		if err != nil {
			d.log.Warn("sweep: list pools", "cluster", cl.ClusterID, "err", err)
			continue
		}
		for _, pool := range pools {
			d.sweepPool(o, cl.ClusterID, pool, cl.RBD.RadosNamespace)
		}
	}
}

func (d *Driver) sweepPool(o ceph.Options, cluster, pool, namespace string) {
	j := d.journal(o, pool, namespace)
	gone, err := list[goneRecord](j, jGone)
	if err != nil {
		return // not a pool we journal in, or cannot read
	}
	for id := range gone {
		d.collectGone(o, cluster, ceph.ImageRef{Pool: pool, Namespace: namespace, ID: id})
	}
	owed, err := list[flattenRecord](j, jFlatten)
	if err != nil {
		return
	}
	for id, rec := range owed {
		ref := ceph.ImageRef{Pool: pool, Namespace: namespace, ID: id}
		if d.flat.running(cluster, ref) != nil {
			continue
		}
		d.log.Info("resuming an owed flatten", "image", rec.Image, "reason", rec.Reason, "since", rec.Since)
		chain, err := d.cfg.Images.ParentChain(o, ref, 0)
		if errors.Is(err, ceph.ErrImageNotFound) {
			j.update(nil, flattenKey(ref))
			continue
		}
		if _, err := d.flat.start(cluster, o, j, ref, rec.Image, rec.Reason, func() {
			d.collectChain(o, cluster, chain)
		}); err != nil {
			d.log.Warn("sweep: resume flatten", "image", rec.Image, "err", err)
		}
	}
}
