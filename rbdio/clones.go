package rbdio

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"syscall"
	"time"

	"github.com/ceph/go-ceph/rados"
	"github.com/ceph/go-ceph/rbd"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
)

// Clones, parent chains, flatten and renames for the CSI controller.

// maxChain bounds a parent-chain walk: Ceph allows no loop, but a
// corrupt or hostile header must not hang the controller.
const maxChain = 64

// CloneImage creates child as a format-2 clone of parent (parent.Snap
// names the snapshot) with n's features, data pool and metadata, grown
// to n.Size if that is larger than the snapshot. Format 2 needs no
// protected snapshot, and lets the snapshot be removed while the clone
// lives. A failed call removes the child again.
func (c *Clusters) CloneImage(o ceph.Options, parent, child ceph.ImageSpec, n ceph.NewImage) error {
	pio, prel, err := c.ioctx(o, parent)
	if err != nil {
		return err
	}
	defer prel()
	cio, crel, err := c.ioctx(o, child)
	if err != nil {
		return err
	}
	defer crel()
	opts := rbd.NewRbdImageOptions()
	defer opts.Destroy()
	if err := opts.SetUint64(rbd.ImageOptionCloneFormat, 2); err != nil {
		return fmt.Errorf("clone %s: clone format: %w", child, err)
	}
	if n.Features != nil {
		if err := opts.SetUint64(rbd.ImageOptionFeatures, uint64(rbd.FeatureSetFromNames(n.Features))); err != nil {
			return fmt.Errorf("clone %s: features: %w", child, err)
		}
	}
	if n.DataPool != "" {
		if err := opts.SetString(rbd.ImageOptionDataPool, n.DataPool); err != nil {
			return fmt.Errorf("clone %s: data pool: %w", child, err)
		}
	}
	if err := rbd.CloneImage(pio, parent.Image, parent.Snap, cio, child.Image, opts); err != nil {
		if cephErrno(err) == syscall.ENOENT {
			return matching{fmt.Errorf("clone %s from %s: the parent or its snapshot does not exist", child, parent),
				ceph.ErrImageNotFound}
		}
		return fmt.Errorf("clone %s from %s: %w", child, parent, classify(err))
	}
	if err := finishClone(cio, child, n); err != nil {
		rbd.RemoveImage(cio, child.Image)
		return err
	}
	return nil
}

func finishClone(cio *rados.IOContext, child ceph.ImageSpec, n ceph.NewImage) error {
	img, err := rbd.OpenImage(cio, child.Image, rbd.NoSnapshot)
	if err != nil {
		return imageError(child, "open", err)
	}
	defer img.Close()
	for _, k := range slices.Sorted(maps.Keys(n.Meta)) {
		if err := img.SetMetadata(k, n.Meta[k]); err != nil {
			return imageError(child, "set metadata of", err)
		}
	}
	size, err := img.GetSize()
	if err != nil {
		return imageError(child, "size of", err)
	}
	if n.Size > size {
		if err := img.Resize(n.Size); err != nil {
			return imageError(child, "grow", err)
		}
	}
	return nil
}

// ParentChain walks the parents of ref's image as seen from its snapshot
// snapID (0: the image itself), nearest first. Parents in the RBD trash
// or renamed count like any other: each is a link a read may have to
// follow.
func (c *Clusters) ParentChain(o ceph.Options, ref ceph.ImageRef, snapID uint64) ([]ceph.Link, error) {
	conn, release, err := c.get(o)
	if err != nil {
		return nil, err
	}
	defer release()
	var chain []ceph.Link
	cur, snap := ref, snapID
	for range maxChain {
		link, ok, err := parentOf(conn, cur, snap)
		if err != nil || !ok {
			return chain, err
		}
		chain = append(chain, link)
		cur, snap = link.Ref(), link.SnapID
	}
	return chain, fmt.Errorf("parent chain of %s is longer than %d", ref, maxChain)
}

// parentOf is the parent of ref's image at snapshot snapID, if any.
func parentOf(conn *rados.Conn, ref ceph.ImageRef, snapID uint64) (ceph.Link, bool, error) {
	ioctx, err := conn.OpenIOContext(ref.Pool)
	if err != nil {
		if cephErrno(err) == syscall.ENOENT {
			return ceph.Link{}, false, matching{fmt.Errorf("pool %q does not exist", ref.Pool), ceph.ErrPoolNotFound}
		}
		return ceph.Link{}, false, fmt.Errorf("pool %q: %w", ref.Pool, err)
	}
	defer ioctx.Destroy()
	ioctx.SetNamespace(ref.Namespace)
	img, err := rbd.OpenImageByIdReadOnly(ioctx, ref.ID, rbd.NoSnapshot)
	if err != nil {
		return ceph.Link{}, false, refError(ref, "open", err)
	}
	defer img.Close()
	if snapID != 0 {
		if err := img.SetSnapByID(snapID); err != nil {
			return ceph.Link{}, false, fmt.Errorf("snapshot %d of %s: %w", snapID, ref, classify(err))
		}
	}
	pi, err := img.GetParent()
	if cephErrno(err) == syscall.ENOENT {
		return ceph.Link{}, false, nil
	}
	if err != nil {
		return ceph.Link{}, false, fmt.Errorf("parent of %s: %w", ref, classify(err))
	}
	return ceph.Link{Pool: pi.Image.PoolName, Namespace: pi.Image.PoolNamespace, ImageID: pi.Image.ImageID,
		Image: pi.Image.ImageName, SnapID: pi.Snap.ID, Snap: pi.Snap.SnapName, Trash: pi.Image.Trash}, true, nil
}

// ErrFlattenStopped: a flatten was cancelled through its stop channel.
// librbd stops between objects; what it copied stays, and a later
// flatten goes on from there.
var ErrFlattenStopped = errors.New("flatten stopped")

// Flatten copies into ref's image everything it reads from its parents
// and cuts it loose from them (with deep-flatten, its snapshots too).
// report is called every interval with the objects done and the total;
// closing stop cancels. An image without a parent is already flat.
//
// resumed says an earlier flatten of the image may have died mid-way;
// an image whose exclusive lock another client holds counts as one.
// librbd marks an object as existing in the object map before it copies
// it up; a client killed in between leaves the mark on an object that
// is not there, a later flatten skips it, and once the parent is cut
// loose the object reads as zeros (seen with Ceph 16.2.15: a whole 4 MiB
// object lost; `rbd object-map rebuild` does not clear the mark). So a
// resumed flatten first turns the object map off and on, which leaves
// it invalid: librbd then copies up every object it cannot see (the
// OSD's copyup writes only objects that do not exist), and the map is
// rebuilt once the image is flat. With the image mapped elsewhere, the
// lock owner makes both feature changes (seen working); should one be
// refused, the flatten fails with ceph.ErrLocked and stays owed.
func (c *Clusters) Flatten(o ceph.Options, ref ceph.ImageRef, resumed bool, stop <-chan struct{}, interval time.Duration,
	report func(done, total uint64)) error {
	ioctx, release, err := c.ioctx(o, refSpec(ref))
	if err != nil {
		return err
	}
	defer release()
	m, err := openMgmt(ioctx, "", ref.ID, false)
	if err != nil {
		return refError(ref, "open", err)
	}
	defer m.close()
	// Held by another client (a node has the volume mapped), librbd
	// runs the flatten there; should that client die mid-way, librbd
	// runs the rest here, on the map it left. Distrust it then too.
	if !resumed {
		owners, err := m.lockOwners()
		if err != nil {
			return refError(ref, "lock owners of", err)
		}
		resumed = owners > 0
	}
	if resumed {
		if err := m.distrustObjectMap(); err != nil {
			return fmt.Errorf("flatten %s: reset its object map: %w", ref, err)
		}
	}
	p := newProgress()
	defer p.free()
	done := make(chan error, 1)
	go func() { done <- m.flatten(p) }()
	tick := time.NewTicker(interval)
	defer tick.Stop()
	stopped := false
	for {
		select {
		case err := <-done:
			switch {
			case err == nil, errors.Is(err, syscall.EINVAL): // EINVAL: no parent
				return m.repairObjectMap()
			case stopped && errors.Is(err, syscall.ECANCELED):
				return ErrFlattenStopped
			}
			return fmt.Errorf("flatten %s: %w", ref, classify(err))
		case <-tick.C:
			if report != nil {
				report(p.get())
			}
		case <-stop:
			if !stopped {
				stopped = true
				p.cancel()
			}
			stop = nil
		}
	}
}

// distrustObjectMap turns the object map (and fast-diff) off and on, if
// the image has one, leaving it invalid until rebuilt.
func (m mImage) distrustObjectMap() error {
	f, err := m.features()
	if err != nil || f&featureObjectMap == 0 {
		return err
	}
	both := uint64(featureObjectMap) | f&featureFastDiff
	if err := m.updateFeatures(both, false); err != nil {
		if errors.Is(err, syscall.EROFS) || errors.Is(err, syscall.EBUSY) {
			return matching{fmt.Errorf("the image is in use by another client: %w", err), ceph.ErrLocked}
		}
		return classify(err)
	}
	return classify(m.updateFeatures(both, true))
}

// repairObjectMap rebuilds an object map left invalid, so fast-diff
// (used bytes, export-diff) works again.
func (m mImage) repairObjectMap() error {
	f, err := m.flags()
	if err != nil || f&objectMapInvalid == 0 {
		return err
	}
	if err := m.rebuildObjectMap(); err != nil {
		return fmt.Errorf("rebuild the object map: %w", classify(err))
	}
	return nil
}

// RenameImage renames spec's image to name. Clones find their parent by
// ID, so a parent may be renamed under them.
func (c *Clusters) RenameImage(o ceph.Options, spec ceph.ImageSpec, name string) error {
	ioctx, release, err := c.ioctx(o, spec)
	if err != nil {
		return err
	}
	defer release()
	if err := rbd.GetImage(ioctx, spec.Image).Rename(name); err != nil {
		return imageError(spec, "rename", err)
	}
	return nil
}

// UpdateMetadata sets and removes metadata keys of spec's image (a
// missing key to remove is fine).
func (c *Clusters) UpdateMetadata(o ceph.Options, spec ceph.ImageSpec, set map[string]string, rm []string) error {
	img, release, err := c.image(o, spec, false)
	if err != nil {
		return err
	}
	defer release()
	for _, k := range slices.Sorted(maps.Keys(set)) {
		if err := img.SetMetadata(k, set[k]); err != nil {
			return imageError(spec, "set metadata of", err)
		}
	}
	for _, k := range rm {
		if err := img.RemoveMetadata(k); err != nil && cephErrno(err) != syscall.ENOENT {
			return imageError(spec, "remove metadata of", err)
		}
	}
	return nil
}
