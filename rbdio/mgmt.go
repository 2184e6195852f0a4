package rbdio

// The few management calls go-ceph does not wrap in a form we can use:
// a snapshot with quiesce flags (rbd_snap_create2), a flatten whose
// progress we can read and which we can cancel, and an image's current
// name when it was opened by ID. Same rule as aio.go: the C progress
// callback only stores numbers; Go reads them.

/*
#cgo LDFLAGS: -lrbd
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <rbd/librbd.h>

struct nbdgo_progress {
	uint64_t done, total; // written by librbd's callback (atomic)
	int32_t cancel;       // set by Go: the callback then asks librbd to stop
};

static int nbdgo_progress_cb(uint64_t done, uint64_t total, void *arg) {
	struct nbdgo_progress *p = arg;
	__atomic_store_n(&p->done, done, __ATOMIC_RELAXED);
	__atomic_store_n(&p->total, total, __ATOMIC_RELAXED);
	return __atomic_load_n(&p->cancel, __ATOMIC_RELAXED) ? -125 : 0; // -ECANCELED
}

static int nbdgo_noprogress(uint64_t done, uint64_t total, void *arg) { return 0; }

static int nbdgo_snap_create(rbd_image_t img, const char *name, uint32_t flags) {
	return rbd_snap_create2(img, name, flags, nbdgo_noprogress, NULL);
}

static int nbdgo_flatten(rbd_image_t img, struct nbdgo_progress *p) {
	return rbd_flatten_with_progress(img, nbdgo_progress_cb, p);
}

static int nbdgo_rebuild_object_map(rbd_image_t img) {
	return rbd_rebuild_object_map(img, nbdgo_noprogress, NULL);
}

// How many clients hold the image's exclusive lock (0 or 1): an
// image without the feature, or unlocked, has none.
static int nbdgo_lock_owners(rbd_image_t img) {
	rbd_lock_mode_t mode;
	char *owners[4];
	size_t n = 4;
	int r = rbd_lock_get_owners(img, &mode, owners, &n);
	if (r == -ENOENT)
		return 0;
	if (r < 0)
		return r;
	rbd_lock_get_owners_cleanup(owners, n);
	return (int)n;
}

static uint64_t nbdgo_load(uint64_t *v) { return __atomic_load_n(v, __ATOMIC_RELAXED); }
static void nbdgo_cancel(struct nbdgo_progress *p) { __atomic_store_n(&p->cancel, 1, __ATOMIC_RELAXED); }
*/
import "C"

import (
	"syscall"
	"unsafe"

	"github.com/ceph/go-ceph/rados"
)

// mImage is a management handle: an rbd_image_t of our own, for the
// calls above. It has no completion queue (cImage's data path).
type mImage struct{ p C.rbd_image_t }

// openMgmt opens an image by name, or by ID when id is set (a renamed or
// trashed image is still found by ID).
func openMgmt(ioctx *rados.IOContext, name, id string, readOnly bool) (mImage, error) {
	io := C.rados_ioctx_t(ioctx.Pointer())
	var img C.rbd_image_t
	var r C.int
	if id != "" {
		cid := C.CString(id)
		defer C.free(unsafe.Pointer(cid))
		if readOnly {
			r = C.rbd_open_by_id_read_only(io, cid, &img, nil)
		} else {
			r = C.rbd_open_by_id(io, cid, &img, nil)
		}
	} else {
		cname := C.CString(name)
		defer C.free(unsafe.Pointer(cname))
		if readOnly {
			r = C.rbd_open_read_only(io, cname, &img, nil)
		} else {
			r = C.rbd_open(io, cname, &img, nil)
		}
	}
	return mImage{p: img}, errnoOf(r)
}

func (m mImage) close() { C.rbd_close(m.p) }

// name is the image's current name (rbd_get_name).
func (m mImage) name() (string, error) {
	buf := make([]byte, 256)
	for {
		n := C.size_t(len(buf))
		r := C.rbd_get_name(m.p, (*C.char)(unsafe.Pointer(&buf[0])), &n)
		if r == -C.int(syscall.ERANGE) && int(n) > len(buf) {
			buf = make([]byte, n)
			continue
		}
		if err := errnoOf(r); err != nil {
			return "", err
		}
		return C.GoString((*C.char)(unsafe.Pointer(&buf[0]))), nil
	}
}

// snapCreate is rbd_snap_create2: librbd notifies every client that
// registered a quiesce watch and waits for them (a mapped device
// freezes its filesystem) unless told to ignore their errors.
func (m mImage) snapCreate(name string, ignoreQuiesceErrors bool) error {
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	var flags C.uint32_t
	if ignoreQuiesceErrors {
		flags = C.RBD_SNAP_CREATE_IGNORE_QUIESCE_ERROR
	}
	return errnoOf(C.nbdgo_snap_create(m.p, cname, flags))
}

// progress is a long operation's progress, written by librbd's thread
// and read by Go; C memory, so librbd may hold it during the call.
type progress struct{ p *C.struct_nbdgo_progress }

func newProgress() progress {
	return progress{p: (*C.struct_nbdgo_progress)(C.calloc(1, C.sizeof_struct_nbdgo_progress))}
}

func (p progress) free() { C.free(unsafe.Pointer(p.p)) }

// get returns what is done of the total (librbd counts objects).
func (p progress) get() (done, total uint64) {
	return uint64(C.nbdgo_load(&p.p.done)), uint64(C.nbdgo_load(&p.p.total))
}

// cancel makes the running operation stop at its next progress report.
func (p progress) cancel() { C.nbdgo_cancel(p.p) }

// flatten is rbd_flatten_with_progress. If the image's exclusive lock is
// held elsewhere (a node has it mapped), librbd asks the lock owner to
// run it and relays its progress.
func (m mImage) flatten(p progress) error { return errnoOf(C.nbdgo_flatten(m.p, p.p)) }

// Image flags (rbd_get_flags): RBD_FLAG_OBJECT_MAP_INVALID and
// RBD_FLAG_FAST_DIFF_INVALID.
func (m mImage) flags() (uint64, error) {
	var f C.uint64_t
	err := errnoOf(C.rbd_get_flags(m.p, &f))
	return uint64(f), err
}

// objectMapInvalid: the image has an object map librbd does not trust.
const objectMapInvalid = C.RBD_FLAG_OBJECT_MAP_INVALID

// features is rbd_get_features.
func (m mImage) features() (uint64, error) {
	var f C.uint64_t
	err := errnoOf(C.rbd_get_features(m.p, &f))
	return uint64(f), err
}

const (
	featureObjectMap = C.RBD_FEATURE_OBJECT_MAP
	featureFastDiff  = C.RBD_FEATURE_FAST_DIFF
)

// updateFeatures is rbd_update_features.
func (m mImage) updateFeatures(f uint64, enable bool) error {
	return errnoOf(C.rbd_update_features(m.p, C.uint64_t(f), C.uint8_t(boolInt(enable))))
}

// rebuildObjectMap is rbd_rebuild_object_map.
func (m mImage) rebuildObjectMap() error { return errnoOf(C.nbdgo_rebuild_object_map(m.p)) }

// lockOwners is how many clients hold the image's exclusive lock.
func (m mImage) lockOwners() (int, error) {
	r := C.nbdgo_lock_owners(m.p)
	if r < 0 {
		return 0, errnoOf(r)
	}
	return int(r), nil
}
