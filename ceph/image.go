package ceph

import (
	"errors"
	"fmt"
	"strings"
)

// Errors that image management (rbdio) wraps, so callers above rbdio can
// tell them apart without linking librbd.
var (
	ErrImageNotFound = errors.New("image not found")
	ErrPoolNotFound  = errors.New("pool not found")
	// ErrImageInUse: the image has watchers (it is mapped or open
	// somewhere), so it is not removed.
	ErrImageInUse = errors.New("image is in use")
	// ErrPermission: the cluster refused the credentials or the
	// operation.
	ErrPermission = errors.New("permission denied")
	// ErrLocked: another client holds the image's exclusive lock (it
	// is mapped for writing somewhere else).
	ErrLocked = errors.New("exclusive lock held by another client")
	// ErrUnreachable: no monitor answered in time.
	ErrUnreachable = errors.New("cluster unreachable")
)

// NewImage describes an image to create.
type NewImage struct {
	Size uint64
	// Features are RBD feature names (layering, exclusive-lock, ...);
	// nil means librbd's default set.
	Features []string
	// DataPool, if set, holds the image's data objects (erasure-coded
	// pools), the image's metadata staying in its own pool.
	DataPool string
	// Meta is set as image metadata right after creation.
	Meta map[string]string
}

// ImageInfo is what image management reports of an image.
type ImageInfo struct {
	Spec ImageSpec
	// ID is the RBD image ID, which a rename keeps.
	ID       string
	Size     uint64
	Features []string
	Meta     map[string]string
	// Watchers counts the clients watching the image: each mapped or
	// open copy has one.
	Watchers int
	// Parent is the image this one is cloned from, if any.
	Parent *Link
}

// HasFeature reports whether the image has the named feature.
func (i ImageInfo) HasFeature(name string) bool {
	for _, f := range i.Features {
		if f == name {
			return true
		}
	}
	return false
}

// features are the RBD feature names a new image may ask for.
var features = []string{"layering", "striping", "exclusive-lock", "object-map", "fast-diff",
	"deep-flatten", "journaling", "data-pool"}

// ParseFeatures reads a comma-separated feature list (the StorageClass's
// imageFeatures), refusing names RBD does not know.
func ParseFeatures(s string) ([]string, error) {
	var out []string
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		known := false
		for _, k := range features {
			known = known || k == f
		}
		if !known {
			return nil, fmt.Errorf("unknown RBD image feature %q (known: %s)", f, strings.Join(features, ", "))
		}
		out = append(out, f)
	}
	return out, nil
}
