package rbdio

import (
	"errors"
	"fmt"
	"syscall"
	"time"

	"github.com/ceph/go-ceph/rados"
	"github.com/ceph/go-ceph/rbd"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
)

// Snapshot management for the CSI controller: snapshots live on the
// volume's own image (so export-diff and changed-block tracking between
// them work), are found again by image ID after the volume is renamed
// out of the way, and are removed through librbd, which keeps one that
// clones still depend on in its trash namespace until they are gone.

// CreateSnapshot takes snapshot name of spec's image, or returns it if
// it already exists (a retried call). With ceph.QuiesceRequired a client
// that cannot quiesce (freeze its filesystem) fails the snapshot; with
// QuiesceBestEffort the snapshot is taken anyway.
func (c *Clusters) CreateSnapshot(o ceph.Options, spec ceph.ImageSpec, name string, q ceph.Quiesce) (ceph.SnapshotOf, error) {
	ioctx, release, err := c.ioctx(o, spec)
	if err != nil {
		return ceph.SnapshotOf{}, err
	}
	defer release()
	s, err := findSnapshot(ioctx, spec, name)
	if !errors.Is(err, ceph.ErrSnapshotNotFound) {
		return s, err
	}
	m, err := openMgmt(ioctx, spec.Image, "", false)
	if err != nil {
		return s, imageError(spec, "open", err)
	}
	err = m.snapCreate(name, q == ceph.QuiesceBestEffort)
	m.close()
	if err != nil && !errors.Is(err, syscall.EEXIST) {
		if errors.Is(err, syscall.ETIMEDOUT) || errors.Is(err, syscall.EIO) {
			// What librbd returns when a quiesce watcher did not answer
			// or failed to freeze.
			return s, fmt.Errorf("snapshot %s@%s: a client of the image could not quiesce: %w", spec, name, classify(err))
		}
		return s, fmt.Errorf("snapshot %s@%s: %w", spec, name, classify(err))
	}
	return findSnapshot(ioctx, spec, name)
}

// GetSnapshot finds snapshot snapID of the image ref names.
func (c *Clusters) GetSnapshot(o ceph.Options, ref ceph.ImageRef, snapID uint64) (ceph.SnapshotOf, error) {
	ioctx, release, err := c.ioctx(o, refSpec(ref))
	if err != nil {
		return ceph.SnapshotOf{}, err
	}
	defer release()
	return findSnapshotByID(ioctx, ref, snapID)
}

// ListSnapshots lists every snapshot of spec's image, those in the trash
// namespace included.
func (c *Clusters) ListSnapshots(o ceph.Options, spec ceph.ImageSpec) ([]ceph.Snapshot, error) {
	img, release, err := c.image(o, spec, true)
	if err != nil {
		return nil, err
	}
	defer release()
	return snapshots(img, spec)
}

// RemoveSnapshot removes snapshot snapID of ref's image. One that clones
// depend on moves to the trash namespace (clone format 2) and goes when
// they do. A missing image or snapshot is ceph.ErrImageNotFound or
// ceph.ErrSnapshotNotFound.
func (c *Clusters) RemoveSnapshot(o ceph.Options, ref ceph.ImageRef, snapID uint64) error {
	ioctx, release, err := c.ioctx(o, refSpec(ref))
	if err != nil {
		return err
	}
	defer release()
	img, err := rbd.OpenImageById(ioctx, ref.ID, rbd.NoSnapshot)
	if err != nil {
		return refError(ref, "open", err)
	}
	defer img.Close()
	if err := img.RemoveSnapByID(snapID); err != nil {
		if cephErrno(err) == syscall.ENOENT {
			return matching{fmt.Errorf("image %s has no snapshot %d", ref, snapID), ceph.ErrSnapshotNotFound}
		}
		return fmt.Errorf("remove snapshot %d of %s: %w", snapID, ref, classify(err))
	}
	return nil
}

// Children lists the images cloned from snapshot snapID of ref's image,
// those in the RBD trash included.
func (c *Clusters) Children(o ceph.Options, ref ceph.ImageRef, snapID uint64) ([]ceph.Child, error) {
	ioctx, release, err := c.ioctx(o, refSpec(ref))
	if err != nil {
		return nil, err
	}
	defer release()
	img, err := rbd.OpenImageByIdReadOnly(ioctx, ref.ID, rbd.NoSnapshot)
	if err != nil {
		return nil, refError(ref, "open", err)
	}
	defer img.Close()
	if err := img.SetSnapByID(snapID); err != nil {
		if cephErrno(err) == syscall.ENOENT {
			return nil, matching{fmt.Errorf("image %s has no snapshot %d", ref, snapID), ceph.ErrSnapshotNotFound}
		}
		return nil, fmt.Errorf("snapshot %d of %s: %w", snapID, ref, classify(err))
	}
	specs, err := img.ListChildrenAttributes()
	if err != nil {
		return nil, fmt.Errorf("children of %s@%d: %w", ref, snapID, classify(err))
	}
	out := make([]ceph.Child, 0, len(specs))
	for _, s := range specs {
		out = append(out, ceph.Child{Pool: s.PoolName, Namespace: s.PoolNamespace, ID: s.ImageID,
			Image: s.ImageName, Trash: s.Trash})
	}
	return out, nil
}

// findSnapshot looks snapshot name up on the image spec names.
func findSnapshot(ioctx *rados.IOContext, spec ceph.ImageSpec, name string) (ceph.SnapshotOf, error) {
	img, err := rbd.OpenImageReadOnly(ioctx, spec.Image, rbd.NoSnapshot)
	if err != nil {
		return ceph.SnapshotOf{}, imageError(spec, "open", err)
	}
	defer img.Close()
	all, err := snapshots(img, spec)
	if err != nil {
		return ceph.SnapshotOf{}, err
	}
	imageID, err := img.GetId()
	if err != nil {
		return ceph.SnapshotOf{}, imageError(spec, "ID of", err)
	}
	for _, s := range all {
		if s.Name == name && !s.Trash {
			return ceph.SnapshotOf{Image: ceph.ImageRef{Pool: spec.Pool, Namespace: spec.Namespace, ID: imageID},
				ImageName: spec.Image, Snapshot: s}, nil
		}
	}
	return ceph.SnapshotOf{}, matching{fmt.Errorf("image %s has no snapshot %q", spec, name), ceph.ErrSnapshotNotFound}
}

func findSnapshotByID(ioctx *rados.IOContext, ref ceph.ImageRef, snapID uint64) (ceph.SnapshotOf, error) {
	m, err := openMgmt(ioctx, "", ref.ID, true)
	if err != nil {
		return ceph.SnapshotOf{}, refError(ref, "open", err)
	}
	name, err := m.name()
	m.close()
	if err != nil {
		return ceph.SnapshotOf{}, refError(ref, "name of", err)
	}
	spec := ceph.ImageSpec{Pool: ref.Pool, Namespace: ref.Namespace, Image: name}
	img, err := rbd.OpenImageByIdReadOnly(ioctx, ref.ID, rbd.NoSnapshot)
	if err != nil {
		return ceph.SnapshotOf{}, refError(ref, "open", err)
	}
	defer img.Close()
	all, err := snapshots(img, spec)
	if err != nil {
		return ceph.SnapshotOf{}, err
	}
	for _, s := range all {
		if s.ID == snapID {
			return ceph.SnapshotOf{Image: ref, ImageName: name, Snapshot: s}, nil
		}
	}
	return ceph.SnapshotOf{}, matching{fmt.Errorf("image %s has no snapshot %d", spec, snapID), ceph.ErrSnapshotNotFound}
}

// snapshots lists an open image's snapshots with their namespaces and
// times.
func snapshots(img *rbd.Image, spec ceph.ImageSpec) ([]ceph.Snapshot, error) {
	infos, err := img.GetSnapshotNames()
	if err != nil {
		return nil, imageError(spec, "snapshots of", err)
	}
	out := make([]ceph.Snapshot, 0, len(infos))
	for _, si := range infos {
		s := ceph.Snapshot{ID: si.Id, Name: si.Name, Size: si.Size}
		ns, err := img.GetSnapNamespaceType(si.Id)
		if cephErrno(err) == syscall.ENOENT {
			continue // removed while we looked
		}
		if err != nil {
			return nil, imageError(spec, "snapshot namespace of", err)
		}
		s.Trash = ns == rbd.SnapNamespaceTypeTrash
		if ts, err := img.GetSnapTimestamp(si.Id); err == nil {
			s.Created = time.Unix(int64(ts.Sec), int64(ts.Nsec))
		}
		out = append(out, s)
	}
	return out, nil
}

func refSpec(ref ceph.ImageRef) ceph.ImageSpec {
	return ceph.ImageSpec{Pool: ref.Pool, Namespace: ref.Namespace}
}

func refError(ref ceph.ImageRef, what string, err error) error {
	if cephErrno(err) == syscall.ENOENT {
		return matching{fmt.Errorf("%s image %s: no such image", what, ref), ceph.ErrImageNotFound}
	}
	return fmt.Errorf("%s image %s: %w", what, ref, classify(err))
}

// ImageName is the current name of the image ref names by ID.
func (c *Clusters) ImageName(o ceph.Options, ref ceph.ImageRef) (string, error) {
	ioctx, release, err := c.ioctx(o, refSpec(ref))
	if err != nil {
		return "", err
	}
	defer release()
	m, err := openMgmt(ioctx, "", ref.ID, true)
	if err != nil {
		return "", refError(ref, "open", err)
	}
	defer m.close()
	name, err := m.name()
	if err != nil {
		return "", refError(ref, "name of", err)
	}
	return name, nil
}
