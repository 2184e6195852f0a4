package ceph

import (
	"errors"
	"fmt"
	"time"
)

var (
	// ErrSnapshotNotFound: the image exists but has no such snapshot.
	ErrSnapshotNotFound = errors.New("snapshot not found")
	// ErrHasSnapshots: the image has snapshots (some perhaps kept in
	// the trash namespace for clones), so it cannot be removed.
	ErrHasSnapshots = errors.New("image has snapshots")
)

// ImageRef names an image by its RBD image ID, which survives a rename:
// a snapshot's handle holds it, so the snapshot is found again after its
// volume was deleted and the image renamed out of the way.
type ImageRef struct {
	Pool, Namespace, ID string
}

func (r ImageRef) String() string {
	if r.Namespace != "" {
		return fmt.Sprintf("%s/%s/id:%s", r.Pool, r.Namespace, r.ID)
	}
	return fmt.Sprintf("%s/id:%s", r.Pool, r.ID)
}

// Snapshot is one RBD snapshot of an image.
type Snapshot struct {
	ID      uint64
	Name    string
	Size    uint64
	Created time.Time
	// Trash: removed by its user but kept by librbd while clones
	// depend on it (clone format 2 moves it to the trash namespace and
	// deletes it when the last clone is gone or flattened).
	Trash bool
}

// SnapshotOf is a snapshot together with the image it is on.
type SnapshotOf struct {
	Image     ImageRef
	ImageName string // the image's name now
	Snapshot
}

// Link is one step up a clone's parent chain: the parent image, by ID
// and by name, and the snapshot of it the child was cloned from.
type Link struct {
	Pool, Namespace string
	ImageID, Image  string
	SnapID          uint64
	Snap            string
	// Trash: the parent image sits in the RBD trash.
	Trash bool
}

// Spec is the parent's image spec, snapshot included.
func (l Link) Spec() ImageSpec {
	return ImageSpec{Pool: l.Pool, Namespace: l.Namespace, Image: l.Image, Snap: l.Snap}
}

// Ref is the parent image by ID.
func (l Link) Ref() ImageRef { return ImageRef{Pool: l.Pool, Namespace: l.Namespace, ID: l.ImageID} }

// Quiesce says what a snapshot does about the clients that registered
// for librbd's quiesce notification (a node daemon freezing the
// filesystem on a mapped device).
type Quiesce int

const (
	// QuiesceRequired fails the snapshot if a client cannot quiesce.
	QuiesceRequired Quiesce = iota
	// QuiesceBestEffort asks every client to quiesce but takes the
	// snapshot even if one fails or does not answer (crash-consistent
	// for that client's data).
	QuiesceBestEffort
)

// Child is an image cloned from a snapshot.
type Child struct {
	Pool, Namespace, ID, Image string
	Trash                      bool
}
