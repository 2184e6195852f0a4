package rbdio

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sort"
	"syscall"

	"github.com/ceph/go-ceph/rados"
	"github.com/ceph/go-ceph/rbd"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
)

// Image management for the CSI controller: create, inspect, resize,
// remove and list images, and a pool's free space, through go-ceph on
// the shared connections. Errors wrap ceph's sentinels (ErrImageNotFound,
// ErrPoolNotFound, ErrImageInUse, ErrPermission) so callers above rbdio
// classify them without librbd. Each call is bounded by the identity's
// operation timeouts (ceph.Options), not by a context: librbd's calls
// cannot be cancelled.

// CreateImage creates spec with n's size, features, data pool and
// metadata. If setting the metadata fails the image is removed again, so
// a failed call leaves nothing behind.
func (c *Clusters) CreateImage(o ceph.Options, spec ceph.ImageSpec, n ceph.NewImage) error {
	ioctx, release, err := c.ioctx(o, spec)
	if err != nil {
		return err
	}
	defer release()
	opts := rbd.NewRbdImageOptions()
	defer opts.Destroy()
	if n.Features != nil {
		fs := rbd.FeatureSetFromNames(n.Features)
		if err := opts.SetUint64(rbd.ImageOptionFeatures, uint64(fs)); err != nil {
			return fmt.Errorf("image %s: features: %w", spec, err)
		}
	}
	if n.DataPool != "" {
		if err := opts.SetString(rbd.ImageOptionDataPool, n.DataPool); err != nil {
			return fmt.Errorf("image %s: data pool: %w", spec, err)
		}
	}
	if err := rbd.CreateImage(ioctx, spec.Image, n.Size, opts); err != nil {
		return imageError(spec, "create", err)
	}
	if len(n.Meta) == 0 {
		return nil
	}
	img, err := rbd.OpenImage(ioctx, spec.Image, rbd.NoSnapshot)
	if err == nil {
		for _, k := range slices.Sorted(maps.Keys(n.Meta)) {
			if err = img.SetMetadata(k, n.Meta[k]); err != nil {
				break
			}
		}
		img.Close()
	}
	if err != nil {
		rbd.RemoveImage(ioctx, spec.Image)
		return imageError(spec, "set metadata of", err)
	}
	return nil
}

// ImageInfo reports spec's size, features, metadata and watchers.
func (c *Clusters) ImageInfo(o ceph.Options, spec ceph.ImageSpec) (ceph.ImageInfo, error) {
	ioctx, release, err := c.ioctx(o, spec)
	if err != nil {
		return ceph.ImageInfo{}, err
	}
	defer release()
	return imageInfo(ioctx, spec)
}

func imageInfo(ioctx *rados.IOContext, spec ceph.ImageSpec) (ceph.ImageInfo, error) {
	img, err := rbd.OpenImageReadOnly(ioctx, spec.Image, rbd.NoSnapshot)
	if err != nil {
		return ceph.ImageInfo{}, imageError(spec, "open", err)
	}
	defer img.Close()
	info := ceph.ImageInfo{Spec: spec}
	if info.ID, err = img.GetId(); err != nil {
		return info, imageError(spec, "ID of", err)
	}
	if info.Size, err = img.GetSize(); err != nil {
		return info, imageError(spec, "size of", err)
	}
	fb, err := img.GetFeatures()
	if err != nil {
		return info, imageError(spec, "features of", err)
	}
	fs := rbd.FeatureSet(fb)
	info.Features = fs.Names()
	sort.Strings(info.Features)
	if info.Meta, err = img.ListMetadata(); err != nil {
		return info, imageError(spec, "metadata of", err)
	}
	ws, err := img.ListWatchers()
	if err != nil {
		return info, imageError(spec, "watchers of", err)
	}
	// Our own read-only open does not register a watch.
	info.Watchers = len(ws)
	pi, err := img.GetParent()
	switch {
	case err == nil:
		info.Parent = &ceph.Link{Pool: pi.Image.PoolName, Namespace: pi.Image.PoolNamespace, ImageID: pi.Image.ImageID,
			Image: pi.Image.ImageName, SnapID: pi.Snap.ID, Snap: pi.Snap.SnapName, Trash: pi.Image.Trash}
	case cephErrno(err) != syscall.ENOENT:
		return info, imageError(spec, "parent of", err)
	}
	return info, nil
}

// ResizeImage sets spec's size. Mapped copies follow through their update
// watch.
func (c *Clusters) ResizeImage(o ceph.Options, spec ceph.ImageSpec, size uint64) error {
	img, release, err := c.image(o, spec, false)
	if err != nil {
		return err
	}
	defer release()
	if err := img.Resize(size); err != nil {
		return imageError(spec, "resize", err)
	}
	return nil
}

// image opens spec's image through go-ceph on the shared connection;
// release closes it and drops the connection reference.
func (c *Clusters) image(o ceph.Options, spec ceph.ImageSpec, readOnly bool) (*rbd.Image, func(), error) {
	ioctx, release, err := c.ioctx(o, spec)
	if err != nil {
		return nil, nil, err
	}
	open := rbd.OpenImage
	if readOnly {
		open = rbd.OpenImageReadOnly
	}
	img, err := open(ioctx, spec.Image, rbd.NoSnapshot)
	if err != nil {
		release()
		return nil, nil, imageError(spec, "open", err)
	}
	return img, func() { img.Close(); release() }, nil
}

// RemoveImage removes spec. An image with watchers (mapped or open
// somewhere) is refused with ceph.ErrImageInUse and kept, one with
// snapshots with ceph.ErrHasSnapshots; a missing one is
// ceph.ErrImageNotFound.
func (c *Clusters) RemoveImage(o ceph.Options, spec ceph.ImageSpec) error {
	ioctx, release, err := c.ioctx(o, spec)
	if err != nil {
		return err
	}
	defer release()
	info, err := imageInfo(ioctx, spec)
	if err != nil {
		return err
	}
	if info.Watchers > 0 {
		return fmt.Errorf("image %s has %d watcher(s): %w", spec, info.Watchers, ceph.ErrImageInUse)
	}
	if err := rbd.RemoveImage(ioctx, spec.Image); err != nil {
		return imageError(spec, "remove", err)
	}
	return nil
}

// ListImages returns every image of spec's pool and namespace (spec.Image
// is ignored) whose metadata has key, with its info, sorted by name.
// Images removed while listing are skipped.
func (c *Clusters) ListImages(o ceph.Options, spec ceph.ImageSpec, key string) ([]ceph.ImageInfo, error) {
	ioctx, release, err := c.ioctx(o, spec)
	if err != nil {
		return nil, err
	}
	defer release()
	names, err := rbd.GetImageNames(ioctx)
	if err != nil {
		return nil, fmt.Errorf("list images of %s: %w", spec.Pool, classify(err))
	}
	sort.Strings(names)
	var out []ceph.ImageInfo
	for _, n := range names {
		is := spec
		is.Image = n
		info, err := imageInfo(ioctx, is)
		if errors.Is(err, ceph.ErrImageNotFound) {
			continue
		}
		if err != nil {
			return nil, err
		}
		if _, ok := info.Meta[key]; ok || key == "" {
			out = append(out, info)
		}
	}
	return out, nil
}

// PoolAvailable is how many bytes can still be written to pool (the
// monitor's "df": max_avail, which accounts for replication).
func (c *Clusters) PoolAvailable(o ceph.Options, pool string) (uint64, error) {
	conn, release, err := c.get(o)
	if err != nil {
		return 0, err
	}
	defer release()
	out, _, err := conn.MonCommand([]byte(`{"prefix":"df","format":"json"}`))
	if err != nil {
		return 0, fmt.Errorf("ceph df: %w", classify(err))
	}
	var df struct {
		Pools []struct {
			Name  string `json:"name"`
			Stats struct {
				MaxAvail uint64 `json:"max_avail"`
			} `json:"stats"`
		} `json:"pools"`
	}
	if err := json.Unmarshal(out, &df); err != nil {
		return 0, fmt.Errorf("ceph df: %w", err)
	}
	for _, p := range df.Pools {
		if p.Name == pool {
			return p.Stats.MaxAvail, nil
		}
	}
	if _, err := conn.GetPoolByName(pool); err != nil {
		return 0, matching{fmt.Errorf("pool %q does not exist", pool), ceph.ErrPoolNotFound}
	}
	// Pool statistics come from ceph-mgr: a cluster without one (a
	// minimal dev cluster) has none.
	return 0, matching{fmt.Errorf("no statistics for pool %q (is a ceph-mgr running?)", pool), ceph.ErrUnreachable}
}

// ListPools names the cluster's pools.
func (c *Clusters) ListPools(o ceph.Options) ([]string, error) {
	conn, release, err := c.get(o)
	if err != nil {
		return nil, err
	}
	defer release()
	pools, err := conn.ListPools()
	if err != nil {
		return nil, fmt.Errorf("list pools: %w", classify(err))
	}
	sort.Strings(pools)
	return pools, nil
}

// Ping connects with o (or reuses its connection), and lets go.
func (c *Clusters) Ping(o ceph.Options) error {
	_, release, err := c.get(o)
	if err == nil {
		release()
	}
	return err
}

func imageError(spec ceph.ImageSpec, what string, err error) error {
	return fmt.Errorf("%s image %s: %w", what, spec, classify(err))
}

// classify makes err match the ceph sentinel of its errno, if any,
// keeping its message.
func classify(err error) error {
	switch cephErrno(err) {
	case syscall.ENOENT:
		return matching{err, ceph.ErrImageNotFound}
	case syscall.EBUSY:
		return matching{err, ceph.ErrImageInUse}
	case syscall.EACCES, syscall.EPERM:
		return matching{err, ceph.ErrPermission}
	case syscall.ENOTEMPTY:
		return matching{err, ceph.ErrHasSnapshots}
	}
	return err
}

// matching is err, also matching sentinel under errors.Is.
type matching struct{ err, sentinel error }

func (m matching) Error() string        { return m.err.Error() }
func (m matching) Unwrap() error        { return m.err }
func (m matching) Is(target error) bool { return target == m.sentinel }
