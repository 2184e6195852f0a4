package csi

import "fmt"

// Clone depth and snapshot counts, with ceph-csi's flags and meanings
// (--rbdhardmaxclonedepth, --rbdsoftmaxclonedepth, --maxsnapshotsonimage,
// --minsnapshotsonimage), decided here as pure functions so every case
// is unit-tested; the controller acts on the answers.
//
// A clone's depth is the length of its parent chain: 1 for a clone of a
// flat image. Every link is a hop a read of an unwritten block may take,
// and an OSD op per hop; krbd refuses chains past 16. The hard depth is
// never exceeded by a volume CreateVolume returns; past the soft depth a
// new volume is flattened in the background, so that every volume ends
// at or below it.

// Limits are the controller's clone-depth and snapshot-count bounds.
type Limits struct {
	SoftDepth, HardDepth int
	// MinSnapshots: past it, clones holding an image's removed
	// snapshots in its trash namespace are flattened in the background,
	// so those snapshots go. MaxSnapshots: past it, no snapshot is
	// taken of the image (or temporary one made to clone it) until they
	// are gone.
	MinSnapshots, MaxSnapshots int
}

// DefaultLimits are ceph-csi's defaults. The snapshot counts come from
// krbd's 510 snapshots per image, kept so a volume stays mappable by
// krbd; this driver's data path (librbd) has neither limit.
func DefaultLimits() Limits {
	return Limits{SoftDepth: 4, HardDepth: 8, MinSnapshots: 250, MaxSnapshots: 450}
}

// maxHardDepth is ceph-csi's bound: krbd's 16 links, less room for the
// temporary images ceph-csi adds.
const maxHardDepth = 14

// Validate checks the flags: one line naming the one that is wrong.
func (l Limits) Validate() error {
	switch {
	case l.HardDepth < 1 || l.HardDepth > maxHardDepth:
		return fmt.Errorf("--rbdhardmaxclonedepth %d: want 1 to %d", l.HardDepth, maxHardDepth)
	case l.SoftDepth < 1 || l.SoftDepth > l.HardDepth:
		return fmt.Errorf("--rbdsoftmaxclonedepth %d: want 1 to --rbdhardmaxclonedepth (%d)", l.SoftDepth, l.HardDepth)
	case l.MaxSnapshots < 2:
		return fmt.Errorf("--maxsnapshotsonimage %d: want at least 2", l.MaxSnapshots)
	case l.MinSnapshots < 1 || l.MinSnapshots >= l.MaxSnapshots:
		return fmt.Errorf("--minsnapshotsonimage %d: want 1 to below --maxsnapshotsonimage (%d)", l.MinSnapshots, l.MaxSnapshots)
	}
	return nil
}

// cloneStep is what to do about a clone whose parent (the snapshot or
// volume it is made from) has a chain of parentDepth links.
type cloneStep int

const (
	// cloneNow: the clone's depth is within the soft limit.
	cloneNow cloneStep = iota
	// cloneThenFlatten: make it, and flatten it in the background; the
	// call does not wait.
	cloneThenFlatten
	// flattenParentFirst: the clone would pass the hard limit. Flatten
	// the parent (its chain goes, snapshots included with deep-flatten)
	// and answer Aborted until that is done.
	flattenParentFirst
	// flattenCloneFirst: the clone would pass the hard limit and
	// flattening the parent would not help (a snapshot of an image
	// without deep-flatten keeps its chain). Make the clone, flatten
	// it, and answer Aborted until that is done.
	flattenCloneFirst
)

// cloneStep decides for a parent chain of parentDepth links; deepFlatten
// says whether flattening the parent cuts the chain of the snapshot
// cloned (always, for a volume's head; for a snapshot, only with the
// deep-flatten feature).
func (l Limits) cloneStep(parentDepth int, deepFlatten bool) cloneStep {
	d := parentDepth + 1
	switch {
	case d > l.HardDepth && !deepFlatten:
		return flattenCloneFirst
	case d > l.HardDepth:
		return flattenParentFirst
	case d > l.SoftDepth:
		return cloneThenFlatten
	}
	return cloneNow
}

// snapStep is what to do before another snapshot of an image that has
// total snapshots, trashed of them kept only for clones.
type snapStep struct {
	// FlattenTrashed: flatten the clones of its trashed snapshots in
	// the background, so those snapshots go.
	FlattenTrashed bool
	// Refuse: take no snapshot now. Wait says whether waiting helps
	// (trashed snapshots are going), or the user must delete some.
	Refuse, Wait bool
}

func (l Limits) snapStep(total, trashed int) snapStep {
	var s snapStep
	if total >= l.MinSnapshots && trashed > 0 {
		s.FlattenTrashed = true
	}
	if total >= l.MaxSnapshots {
		s.Refuse = true
		s.Wait = trashed > 0
	}
	return s
}
