package csi

import (
	"fmt"
	"maps"
	"sort"
	"strings"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
)

// Snapshots, clones, flattens and journals of fakeImages, behaving as
// librbd's clone format 2 does: a removed snapshot with clones moves to
// the trash namespace and goes with its last clone; an image with
// snapshots cannot be removed; deep-flatten cuts the snapshots loose.

type fakeSnap struct {
	ceph.Snapshot
	parent *ceph.Link // the image's parent when it was taken
}

type fakeSnapState struct {
	snaps    map[string][]fakeSnap // by image ID
	journal  map[string]map[string]string
	nextID   int
	nextSnap uint64
	// flattenGate, if set, holds every flatten until it is closed.
	flattenGate chan struct{}
	flattens    []string // image IDs flattened, in order
	quiesceErr  error    // CreateSnapshot fails with it, if set
	// keepTrashed: a trashed snapshot stays when its last clone goes,
	// as when librbd's removal of it fails (it ignores the failure).
	keepTrashed bool
}

func (f *fakeImages) snapState() *fakeSnapState {
	if f.ss == nil {
		f.ss = &fakeSnapState{snaps: map[string][]fakeSnap{}, journal: map[string]map[string]string{}}
	}
	return f.ss
}

// newID gives an image its RBD ID (mu held).
func (f *fakeImages) newID() string {
	s := f.snapState()
	s.nextID++
	return fmt.Sprintf("id%04d", s.nextID)
}

// byID finds an image by pool, namespace and ID (mu held).
func (f *fakeImages) byID(ref ceph.ImageRef) (string, ceph.ImageInfo, bool) {
	for k, i := range f.images {
		if i.ID == ref.ID && i.Spec.Pool == ref.Pool && i.Spec.Namespace == ref.Namespace {
			return k, i, true
		}
	}
	return "", ceph.ImageInfo{}, false
}

func (f *fakeImages) ImageName(o ceph.Options, ref ceph.ImageRef) (string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.check(o, ref.Pool); err != nil {
		return "", err
	}
	_, i, ok := f.byID(ref)
	if !ok {
		return "", ceph.ErrImageNotFound
	}
	return i.Spec.Image, nil
}

func (f *fakeImages) CreateSnapshot(o ceph.Options, spec ceph.ImageSpec, name string, q ceph.Quiesce) (ceph.SnapshotOf, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.check(o, spec.Pool); err != nil {
		return ceph.SnapshotOf{}, err
	}
	i, ok := f.images[spec.String()]
	if !ok {
		return ceph.SnapshotOf{}, ceph.ErrImageNotFound
	}
	s := f.snapState()
	ref := ceph.ImageRef{Pool: spec.Pool, Namespace: spec.Namespace, ID: i.ID}
	for _, fs := range s.snaps[i.ID] {
		if fs.Name == name && !fs.Trash {
			return ceph.SnapshotOf{Image: ref, ImageName: spec.Image, Snapshot: fs.Snapshot}, nil
		}
	}
	if s.quiesceErr != nil && q == ceph.QuiesceRequired {
		return ceph.SnapshotOf{}, s.quiesceErr
	}
	s.nextSnap++
	snap := ceph.Snapshot{ID: s.nextSnap, Name: name, Size: i.Size, Created: time.Now()}
	s.snaps[i.ID] = append(s.snaps[i.ID], fakeSnap{Snapshot: snap, parent: i.Parent})
	return ceph.SnapshotOf{Image: ref, ImageName: spec.Image, Snapshot: snap}, nil
}

func (f *fakeImages) GetSnapshot(o ceph.Options, ref ceph.ImageRef, snapID uint64) (ceph.SnapshotOf, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.check(o, ref.Pool); err != nil {
		return ceph.SnapshotOf{}, err
	}
	_, i, ok := f.byID(ref)
	if !ok {
		return ceph.SnapshotOf{}, ceph.ErrImageNotFound
	}
	for _, fs := range f.snapState().snaps[ref.ID] {
		if fs.ID == snapID {
			return ceph.SnapshotOf{Image: ref, ImageName: i.Spec.Image, Snapshot: fs.Snapshot}, nil
		}
	}
	return ceph.SnapshotOf{}, ceph.ErrSnapshotNotFound
}

func (f *fakeImages) ListSnapshots(o ceph.Options, spec ceph.ImageSpec) ([]ceph.Snapshot, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.check(o, spec.Pool); err != nil {
		return nil, err
	}
	i, ok := f.images[spec.String()]
	if !ok {
		return nil, ceph.ErrImageNotFound
	}
	var out []ceph.Snapshot
	for _, fs := range f.snapState().snaps[i.ID] {
		out = append(out, fs.Snapshot)
	}
	return out, nil
}

// childrenOf lists the images cloned from ref@snapID (mu held).
func (f *fakeImages) childrenOf(ref ceph.ImageRef, snapID uint64) []ceph.ImageInfo {
	var out []ceph.ImageInfo
	for _, i := range f.images {
		if p := i.Parent; p != nil && p.ImageID == ref.ID && p.Pool == ref.Pool && p.SnapID == snapID {
			out = append(out, i)
		}
	}
	sort.Slice(out, func(a, b int) bool { return out[a].Spec.Image < out[b].Spec.Image })
	return out
}

func (f *fakeImages) RemoveSnapshot(o ceph.Options, ref ceph.ImageRef, snapID uint64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.check(o, ref.Pool); err != nil {
		return err
	}
	if _, _, ok := f.byID(ref); !ok {
		return ceph.ErrImageNotFound
	}
	s := f.snapState()
	for k, fs := range s.snaps[ref.ID] {
		if fs.ID != snapID {
			continue
		}
		if fs.Trash && len(f.childrenOf(ref, snapID)) > 0 {
			// librbd answers EBUSY to a second remove of a snapshot
			// its clones still hold.
			return fmt.Errorf("remove snapshot %d: busy: %w", snapID, ceph.ErrImageInUse)
		}
		if len(f.childrenOf(ref, snapID)) > 0 {
			s.snaps[ref.ID][k].Trash = true
			s.snaps[ref.ID][k].Name = fmt.Sprintf("trash-%d", snapID)
		} else {
			s.snaps[ref.ID] = append(s.snaps[ref.ID][:k], s.snaps[ref.ID][k+1:]...)
		}
		return nil
	}
	return ceph.ErrSnapshotNotFound
}

func (f *fakeImages) Children(o ceph.Options, ref ceph.ImageRef, snapID uint64) ([]ceph.Child, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []ceph.Child
	for _, i := range f.childrenOf(ref, snapID) {
		out = append(out, ceph.Child{Pool: i.Spec.Pool, Namespace: i.Spec.Namespace, ID: i.ID, Image: i.Spec.Image})
	}
	return out, nil
}

func (f *fakeImages) CloneImage(o ceph.Options, parent, child ceph.ImageSpec, n ceph.NewImage) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.check(o, child.Pool); err != nil {
		return err
	}
	p := parent
	p.Snap = ""
	pi, ok := f.images[p.String()]
	if !ok {
		return ceph.ErrImageNotFound
	}
	var snap *fakeSnap
	for k, fs := range f.snapState().snaps[pi.ID] {
		if fs.Name == parent.Snap && !fs.Trash {
			snap = &f.snapState().snaps[pi.ID][k]
		}
	}
	if snap == nil {
		return fmt.Errorf("clone: %w", ceph.ErrImageNotFound)
	}
	if _, ok := f.images[child.String()]; ok {
		return fmt.Errorf("exists")
	}
	// librbd copies the parent's metadata into the clone (CloneRequest's
	// copy_metadata), then ours goes over it.
	meta := maps.Clone(pi.Meta)
	if meta == nil {
		meta = map[string]string{}
	}
	maps.Copy(meta, n.Meta)
	size := max(n.Size, snap.Size)
	f.images[child.String()] = ceph.ImageInfo{Spec: child, ID: f.newID(), Size: size, Features: n.Features, Meta: meta,
		Parent: &ceph.Link{Pool: parent.Pool, Namespace: parent.Namespace, ImageID: pi.ID, Image: pi.Spec.Image,
			SnapID: snap.ID, Snap: snap.Name}}
	return nil
}

func (f *fakeImages) ParentChain(o ceph.Options, ref ceph.ImageRef, snapID uint64) ([]ceph.Link, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.check(o, ref.Pool); err != nil {
		return nil, err
	}
	var chain []ceph.Link
	for range 64 {
		_, i, ok := f.byID(ref)
		if !ok {
			return chain, ceph.ErrImageNotFound
		}
		link := i.Parent
		if snapID != 0 {
			link = nil
			for _, fs := range f.snapState().snaps[ref.ID] {
				if fs.ID == snapID {
					link = fs.parent
				}
			}
		}
		if link == nil {
			return chain, nil
		}
		chain = append(chain, *link)
		ref, snapID = link.Ref(), link.SnapID
	}
	return chain, fmt.Errorf("loop")
}

func (f *fakeImages) Flatten(o ceph.Options, ref ceph.ImageRef, resumed bool, stop <-chan struct{}, interval time.Duration,
	report func(done, total uint64)) error {
	f.mu.Lock()
	gate := f.snapState().flattenGate
	f.mu.Unlock()
	if gate != nil {
		select {
		case <-gate:
		case <-stop:
			return fmt.Errorf("stopped")
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	k, i, ok := f.byID(ref)
	if !ok {
		return ceph.ErrImageNotFound
	}
	if report != nil {
		report(4, 4)
	}
	p := i.Parent
	i.Parent = nil
	f.images[k] = i
	s := f.snapState()
	if i.HasFeature("deep-flatten") {
		for n := range s.snaps[ref.ID] {
			s.snaps[ref.ID][n].parent = nil
		}
	}
	s.flattens = append(s.flattens, ref.ID)
	if p != nil {
		f.dropTrashed(p.Ref(), p.SnapID)
	}
	return nil
}

// dropTrashed removes a trashed snapshot that lost its last clone (mu
// held), as librbd does.
func (f *fakeImages) dropTrashed(ref ceph.ImageRef, snapID uint64) {
	s := f.snapState()
	if s.keepTrashed || len(f.childrenOf(ref, snapID)) > 0 {
		return
	}
	for k, fs := range s.snaps[ref.ID] {
		if fs.ID == snapID && fs.Trash {
			s.snaps[ref.ID] = append(s.snaps[ref.ID][:k], s.snaps[ref.ID][k+1:]...)
			return
		}
	}
}

func (f *fakeImages) RenameImage(o ceph.Options, spec ceph.ImageSpec, name string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	i, ok := f.images[spec.String()]
	if !ok {
		return ceph.ErrImageNotFound
	}
	delete(f.images, spec.String())
	i.Spec.Image = name
	f.images[i.Spec.String()] = i
	return nil
}

func (f *fakeImages) UpdateMetadata(o ceph.Options, spec ceph.ImageSpec, set map[string]string, rm []string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	i, ok := f.images[spec.String()]
	if !ok {
		return ceph.ErrImageNotFound
	}
	for k, v := range set {
		i.Meta[k] = v
	}
	for _, k := range rm {
		delete(i.Meta, k)
	}
	return nil
}

func journalKey(pool ceph.ImageSpec, oid string) string {
	return pool.Pool + "/" + pool.Namespace + "/" + oid
}

func (f *fakeImages) ReadJournal(o ceph.Options, pool ceph.ImageSpec, oid string, keys []string) (map[string]string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.check(o, pool.Pool); err != nil {
		return nil, err
	}
	out := map[string]string{}
	for _, k := range keys {
		if v, ok := f.snapState().journal[journalKey(pool, oid)][k]; ok {
			out[k] = v
		}
	}
	return out, nil
}

func (f *fakeImages) ListJournal(o ceph.Options, pool ceph.ImageSpec, oid, prefix string) (map[string]string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.check(o, pool.Pool); err != nil {
		return nil, err
	}
	out := map[string]string{}
	for k, v := range f.snapState().journal[journalKey(pool, oid)] {
		if strings.HasPrefix(k, prefix) {
			out[k] = v
		}
	}
	return out, nil
}

func (f *fakeImages) UpdateJournal(o ceph.Options, pool ceph.ImageSpec, oid string, set map[string]string, rm []string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.check(o, pool.Pool); err != nil {
		return err
	}
	s := f.snapState()
	m := s.journal[journalKey(pool, oid)]
	if m == nil {
		m = map[string]string{}
		s.journal[journalKey(pool, oid)] = m
	}
	for k, v := range set {
		m[k] = v
	}
	for _, k := range rm {
		delete(m, k)
	}
	return nil
}
