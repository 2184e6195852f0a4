package rbdio

/*
#cgo LDFLAGS: -lrbd
#include <stdint.h>
#include <rbd/librbd.h>

static int nbdgo_used_cb(uint64_t off, size_t len, int exists, void *arg) {
	if (exists)
		*(uint64_t *)arg += len;
	return 0;
}

// Bytes allocated since the image's creation, at object granularity:
// with fast-diff librbd answers from the object map, without reading
// the objects.
static int nbdgo_used(rbd_image_t img, uint64_t size, uint64_t *used) {
	*used = 0;
	return rbd_diff_iterate2(img, NULL, 0, size, 1, 1, nbdgo_used_cb, used);
}
*/
import "C"

import (
	"errors"
	"fmt"
)

// ErrNoFastDiff: the image has no fast-diff, so used bytes would mean
// reading every object's existence from the OSDs; not reported.
var ErrNoFastDiff = errors.New("image has no fast-diff feature")

// Used returns the bytes the image has allocated (whole objects), for
// volume statistics of raw block volumes.
func (im *Image) Used() (uint64, error) {
	if !im.fastDiff {
		return 0, ErrNoFastDiff
	}
	var used C.uint64_t
	if err := errnoOf(C.nbdgo_used(im.img.p, C.uint64_t(im.Size()), &used)); err != nil {
		return 0, fmt.Errorf("image %s: used bytes: %w", im.spec, err)
	}
	return uint64(used), nil
}
