package csi

import (
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
)

// The controller's journal: the omap of one RADOS object in each pool
// (and RADOS namespace) it puts snapshots in. It holds only what the
// images cannot say themselves:
//
//   - snapshot/NAME: a VolumeSnapshot's CSI name → its record. Names are
//     unique per pool: the same name on another source is AlreadyExists.
//   - snapshot-id/IMAGEID/SNAPID: → the CSI name, for DeleteSnapshot,
//     which gets only the ID.
//   - flatten/IMAGEID: an image a flatten is owed to (a clone past the
//     soft depth, or a parent past the hard one), so a restarted
//     controller finishes it.
//   - gone/IMAGEID: a deleted volume's image kept, renamed, for the
//     snapshots and clones that still need it; removed with the last.
//   - clone/NAME: a clone (or restore) being made at NAME's image, from
//     just before librbd starts it until it is finished. librbd creates
//     the image before it attaches the parent, so a controller killed,
//     or a clone whose clean-up timed out, can leave an image with no
//     parent: this entry is what says it is ours to remove and redo.
//     (One whose PVC was deleted before a retry finished it stays: a
//     few bytes, and the image with no parent, which an admin removes.)
//
// Volumes need no other entry: their image name derives from the CSI
// name.
const journalObject = "rbd-nbd-go.csi"

const (
	jSnapshot   = "snapshot/"
	jSnapshotID = "snapshot-id/"
	jFlatten    = "flatten/"
	jGone       = "gone/"
	jClone      = "clone/"
)

// snapRecord is a VolumeSnapshot as the journal keeps it.
type snapRecord struct {
	// ID is the snapshot ID once taken; empty while it is being taken
	// (the name is reserved for Source).
	ID     string `json:"id,omitempty"`
	Source string `json:"source"` // the source volume ID
	// Snap is the RBD snapshot's name on the source image.
	Snap    string    `json:"snap"`
	Size    uint64    `json:"size,omitempty"`
	Created time.Time `json:"created,omitzero"`
	// Kind is the source volume's access kind (volumeKind), checked
	// when a volume is restored from the snapshot.
	Kind string `json:"kind,omitempty"`
	// NotReady: no restore would fit the hard depth yet, as last seen.
	NotReady bool `json:"not_ready,omitempty"`
}

// flattenRecord is an owed flatten.
type flattenRecord struct {
	Image  string    `json:"image"` // name when it was recorded
	Reason string    `json:"reason"`
	Since  time.Time `json:"since"`
}

// goneRecord is a deleted volume's kept image.
type goneRecord struct {
	Name   string    `json:"name"`   // the image's name now (goneName)
	Volume string    `json:"volume"` // the volume ID it had
	Since  time.Time `json:"since"`
}

// cloneRecord is a clone being made.
type cloneRecord struct {
	Image  string    `json:"image"`  // the clone's image
	Parent string    `json:"parent"` // what it is cloned from
	Since  time.Time `json:"since"`
}

func cloneKey(name string) string         { return jClone + name }
func snapKey(name string) string          { return jSnapshot + name }
func snapIDKey(s snapshotID) string       { return fmt.Sprintf("%s%s/%d", jSnapshotID, s.Image.ID, s.SnapID) }
func flattenKey(ref ceph.ImageRef) string { return jFlatten + ref.ID }
func goneKey(imageID string) string       { return jGone + imageID }

// journal reads and writes the journal of one pool and namespace.
type journal struct {
	images Images
	o      ceph.Options
	pool   ceph.ImageSpec // Pool and Namespace
}

func (d *Driver) journal(o ceph.Options, pool, namespace string) journal {
	return journal{images: d.cfg.Images, o: o, pool: ceph.ImageSpec{Pool: pool, Namespace: namespace}}
}

func (j journal) get(key string, v any) (bool, error) {
	m, err := j.images.ReadJournal(j.o, j.pool, journalObject, []string{key})
	if err != nil {
		return false, err
	}
	s, ok := m[key]
	if !ok {
		return false, nil
	}
	if v == nil {
		return true, nil
	}
	if err := json.Unmarshal([]byte(s), v); err != nil {
		return false, fmt.Errorf("journal %s in pool %s: %w", key, j.pool.Pool, err)
	}
	return true, nil
}

// getString reads a key whose value is a plain string.
func (j journal) getString(key string) (string, bool, error) {
	m, err := j.images.ReadJournal(j.o, j.pool, journalObject, []string{key})
	if err != nil {
		return "", false, err
	}
	s, ok := m[key]
	return s, ok, nil
}

// update sets (values are marshalled unless already strings) and
// removes keys in one atomic operation.
func (j journal) update(set map[string]any, rm ...string) error {
	out := make(map[string]string, len(set))
	for k, v := range set {
		if s, ok := v.(string); ok {
			out[k] = s
			continue
		}
		b, err := json.Marshal(v)
		if err != nil {
			return err
		}
		out[k] = string(b)
	}
	return j.images.UpdateJournal(j.o, j.pool, journalObject, out, rm)
}

// markReady journals a snapshot's readiness if it changed: bulk
// ListSnapshots answers from the journal.
func (j journal) markReady(name string, rec *snapRecord, ready bool) error {
	if rec.NotReady == !ready {
		return nil
	}
	rec.NotReady = !ready
	return j.update(map[string]any{snapKey(name): *rec})
}

// list returns the entries under prefix, keys without the prefix,
// values decoded with decode.
func list[T any](j journal, prefix string) (map[string]T, error) {
	m, err := j.images.ListJournal(j.o, j.pool, journalObject, prefix)
	if err != nil {
		return nil, err
	}
	out := make(map[string]T, len(m))
	for k, s := range m {
		var v T
		if err := json.Unmarshal([]byte(s), &v); err != nil {
			return nil, fmt.Errorf("journal %s in pool %s: %w", k, j.pool.Pool, err)
		}
		out[strings.TrimPrefix(k, prefix)] = v
	}
	return out, nil
}
