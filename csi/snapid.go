package csi

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
)

// A snapshot ID names the RBD snapshot itself, so every call finds it
// without a lookup: "snap1/CLUSTER/POOL/NAMESPACE/IMAGEID/SNAPID", each
// part path-escaped. The image is named by its RBD image ID, which a
// rename keeps: a volume deleted while its snapshots live is renamed
// out of the way, and its snapshots are still found. SNAPID is RBD's
// snapshot ID, never reused within an image.
const snapIDPrefix = "snap1"

// snapshotID is a decoded snapshot ID.
type snapshotID struct {
	ClusterID string
	Image     ceph.ImageRef
	SnapID    uint64
}

func (s snapshotID) String() string {
	parts := []string{snapIDPrefix, s.ClusterID, s.Image.Pool, s.Image.Namespace, s.Image.ID,
		strconv.FormatUint(s.SnapID, 10)}
	for i := 1; i < len(parts); i++ {
		parts[i] = url.PathEscape(parts[i])
	}
	return strings.Join(parts, "/")
}

// errBadSnapshotID: not one of our snapshot IDs. Callers answer NotFound
// (it cannot exist), or success for DeleteSnapshot.
var errBadSnapshotID = errors.New("not a snapshot ID of this driver")

func parseSnapshotID(id string) (snapshotID, error) {
	parts := strings.Split(id, "/")
	if len(parts) != 6 || parts[0] != snapIDPrefix {
		return snapshotID{}, fmt.Errorf("%q: %w (want %s/CLUSTER/POOL/NAMESPACE/IMAGEID/SNAPID)", id, errBadSnapshotID, snapIDPrefix)
	}
	for i := 1; i < len(parts); i++ {
		p, err := url.PathUnescape(parts[i])
		if err != nil {
			return snapshotID{}, fmt.Errorf("%q: %w", id, errBadSnapshotID)
		}
		parts[i] = p
	}
	n, err := strconv.ParseUint(parts[5], 10, 64)
	s := snapshotID{ClusterID: parts[1], Image: ceph.ImageRef{Pool: parts[2], Namespace: parts[3], ID: parts[4]}, SnapID: n}
	if err != nil || n == 0 || s.ClusterID == "" || s.Image.Pool == "" || s.Image.ID == "" ||
		strings.ContainsAny(s.Image.Pool+s.Image.Namespace+s.Image.ID, "/@") {
		return snapshotID{}, fmt.Errorf("%q: %w", id, errBadSnapshotID)
	}
	return s, nil
}

// hashName is a stable name derived from a CSI name: a retry after a
// lost reply finds what the first call made.
func hashName(prefix, name string) string {
	h := sha256.Sum256([]byte(name))
	return fmt.Sprintf("%s%x-%x-%x-%x-%x", prefix, h[0:4], h[4:6], h[6:8], h[8:10], h[10:16])
}

// Names of what the controller makes on an image.
const (
	// defaultSnapPrefix names the RBD snapshot of a VolumeSnapshot,
	// unless the class's snapshotNamePrefix says otherwise (ceph-csi's
	// parameter and default).
	defaultSnapPrefix = "csi-snap-"
	// cloneSnapPrefix names the short-lived snapshot a volume is cloned
	// from; removed right after the clone (kept in the trash namespace
	// while the clone depends on it).
	cloneSnapPrefix = "csi-clone-"
	// gonePrefix names a deleted volume's image kept for its snapshots
	// or clones, with its image ID: unique, and never a CSI volume's
	// name.
	gonePrefix = "csi-gone-"
)

// goneName is the name a deleted volume's image takes while it is kept.
func goneName(imageID string) string { return gonePrefix + imageID }
