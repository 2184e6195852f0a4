package rbdio

// The data path's cgo boundary. rbdio is the only package with C; its
// other cgo files hold management, memory, quiesce and encryption calls.
// Each data-path operation is one C call (create a completion for a slot,
// start the aio); a small C callback sends the request's success reply
// when the NBD layer offered it (nbd.Request.DirectReply), queues the
// finished slot, and signals an eventfd when Go is needed; the reaper (or
// the server, through Reap) drains them in batches, one C call per batch.
// No Go code ever runs on a librbd thread.
//
// librbd allocates with jemalloc, not glibc (memory.go).

/*
#cgo CXXFLAGS: -std=c++17 -O2
#cgo LDFLAGS: -lrbd -lrados -lpthread
#include <errno.h>
#include <stddef.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <rbd/librbd.h>
#include "lend.h"

enum { OP_READ = 0, OP_WRITE = 1, OP_FLUSH = 3, OP_DISCARD = 4, OP_ZEROES = 6 };

// Finished completions wait here until the reaper drains them. The
// callback runs on a librbd thread: it sends the reply itself when it
// may (a direct reply, nbd/direct.go), then only appends under a mutex
// and writes the eventfd when Go is needed: for a completion it did not
// answer, when the image has no more I/O in flight, when LAZY_MAX
// answered ones wait, or while the server waits for requests back. (librbd's own event socket is not used:
// completions that fail before they start, such as a write to a
// read-only image, never reach it.)
enum { LAZY_MAX = 16 };
#define NBDGO_SENT ((uintptr_t)1 << 40) // tag flag: the reply went out

struct nbdgo_img {
	pthread_mutex_t mu;
	int efd;
	uintptr_t *tags;
	int64_t *rets;
	int n, cap;
	int signalled;     // an eventfd write is pending, or a drain will see the queue (mu)
	int lazy;          // answered entries queued since the last drain emptied it (mu)
	uint32_t queued;   // n, for Go's lock-free look (written under mu)
	int32_t waiters;   // connections waiting for requests back (atomic)
	int64_t inflight;  // started and not yet called back (atomic)
};

// nbd's replyPort (nbd/direct.go): one per connection, pinned by Go.
struct nbdgo_port {
	uint32_t lock; // 0 free, 1 us, 2 Go
	int32_t fd;
	uint32_t dead; // 0 live, 1 dead, 2 torn (by us)
};
_Static_assert(sizeof(struct nbdgo_port) == 12 && offsetof(struct nbdgo_port, fd) == 4 &&
               offsetof(struct nbdgo_port, dead) == 8, "nbd's replyPort layout");

struct nbdgo_slot {
	struct nbdgo_img *img;
	uintptr_t tag;
	struct nbdgo_bl *bl; // a lent read's data (lend.cc), set before it starts
	// A direct reply: port (a struct nbdgo_port *) non-zero while one is
	// offered, then hdr, and data (a READ's payload) to send on success.
	// Both are pinned Go pointers, held as integers so that Go code can
	// never store them: see nbdgo_offer.
	uintptr_t port;
	uintptr_t data;
	uint32_t dlen;
	uint32_t hlen;
	unsigned char hdr[32];
};

static struct nbdgo_img *nbdgo_img_new(int efd) {
	struct nbdgo_img *im = calloc(1, sizeof *im);
	if (im == NULL)
		return NULL;
	pthread_mutex_init(&im->mu, NULL);
	im->efd = efd;
	return im;
}

static void nbdgo_img_free(struct nbdgo_img *im) {
	pthread_mutex_destroy(&im->mu);
	free(im->tags);
	free(im->rets);
	free(im);
}

static struct nbdgo_slot *nbdgo_slot_new(struct nbdgo_img *im, uintptr_t tag) {
	struct nbdgo_slot *s = malloc(sizeof *s);
	if (s != NULL) {
		memset(s, 0, sizeof *s);
		s->img = im;
		s->tag = tag;
	}
	return s;
}

// nbdgo_send_reply sends slot s's reply if the port is free and the
// socket takes it whole at once; 1 if it did. It never blocks.
static int nbdgo_send_reply(struct nbdgo_slot *s) {
	struct nbdgo_port *p = (struct nbdgo_port *)s->port;
	uint32_t free_ = 0;
	if (!__atomic_compare_exchange_n(&p->lock, &free_, 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
		return 0;
	int sent = 0;
	if (__atomic_load_n(&p->dead, __ATOMIC_ACQUIRE) == 0) {
		struct iovec iov[2] = {{s->hdr, s->hlen}, {(void *)s->data, s->dlen}};
		struct msghdr m;
		memset(&m, 0, sizeof m);
		m.msg_iov = iov;
		m.msg_iovlen = s->dlen > 0 ? 2 : 1;
		ssize_t want = (ssize_t)s->hlen + s->dlen, n;
		do
			n = sendmsg(p->fd, &m, MSG_DONTWAIT | MSG_NOSIGNAL);
		while (n < 0 && errno == EINTR);
		if (n == want) {
			sent = 1;
		} else if (n > 0) {
			// Cannot happen for a reply nbd offers (see directMax);
			// if it ever does, the stream is torn: end it.
			__atomic_store_n(&p->dead, 2, __ATOMIC_RELEASE);
			shutdown(p->fd, SHUT_RDWR);
		}
	}
	__atomic_store_n(&p->lock, 0, __ATOMIC_RELEASE);
	return sent;
}

static void nbdgo_cb(rbd_completion_t c, void *arg) {
	struct nbdgo_slot *s = arg;
	struct nbdgo_img *im = s->img;
	int64_t ret = rbd_aio_get_return_value(c);
	rbd_aio_release(c);
	int sent = s->port != 0 && ret >= 0 && nbdgo_send_reply(s);
	// No Go pointer is kept past its use (see nbdgo_offer).
	s->port = s->data = 0;
	pthread_mutex_lock(&im->mu);
	if (im->n == im->cap) {
		int cap = im->cap ? 2 * im->cap : 256;
		uintptr_t *t = realloc(im->tags, cap * sizeof *t);
		int64_t *r = realloc(im->rets, cap * sizeof *r);
		if (t == NULL || r == NULL)
			abort(); // out of memory on a completion path: nothing sane remains
		im->tags = t;
		im->rets = r;
		im->cap = cap;
	}
	im->tags[im->n] = s->tag | (sent ? NBDGO_SENT : 0);
	im->rets[im->n] = ret;
	im->n++;
	__atomic_store_n(&im->queued, (uint32_t)im->n, __ATOMIC_RELEASE);
	int64_t left = __atomic_sub_fetch(&im->inflight, 1, __ATOMIC_ACQ_REL);
	int wake = 0;
	if (sent)
		im->lazy++;
	if (!im->signalled && (!sent || left == 0 || im->lazy >= LAZY_MAX ||
	                       __atomic_load_n(&im->waiters, __ATOMIC_SEQ_CST) > 0))
		wake = im->signalled = 1;
	pthread_mutex_unlock(&im->mu);
	if (wake) {
		uint64_t one = 1;
		ssize_t w = write(im->efd, &one, sizeof one);
		(void)w;
	}
}

// nbdgo_offer lets slot s's callback send the request's success reply
// (port non-NULL): hdr, copied, then data. port and data are Go
// pointers, pinned by Go until the slot is reaped. They are stored here,
// in C, as integers, never by Go code: a Go store into a pointer field
// of C memory runs the collector's write barrier, which takes the
// field's old value for a Go pointer, and a slot's old value is the
// previous request's, whose port or buffer may have been freed since.
// That crashed the daemon ("found bad pointer in Go heap") right after
// unmaps, when collections run and freed spans get reused.
static void nbdgo_offer(struct nbdgo_slot *s, struct nbdgo_port *port,
                        const char *hdr, uint32_t hlen, const char *data, uint32_t dlen) {
	s->port = (uintptr_t)port;
	s->data = 0;
	s->dlen = 0;
	s->hlen = 0;
	if (port == NULL)
		return;
	if (hlen > sizeof s->hdr)
		hlen = sizeof s->hdr;
	memcpy(s->hdr, hdr, hlen);
	s->hlen = hlen;
	s->data = (uintptr_t)data;
	s->dlen = dlen;
}

// nbdgo_aio starts one operation whose completion reports slot s, with
// the reply offered as nbdgo_offer says.
static int nbdgo_aio(rbd_image_t img, int op, uint64_t off, uint64_t len,
                     char *buf, int zero_flags, struct nbdgo_slot *s,
                     struct nbdgo_port *port, const char *hdr, uint32_t hlen,
                     const char *data, uint32_t dlen) {
	nbdgo_offer(s, port, hdr, hlen, data, dlen);
	rbd_completion_t c;
	int r = rbd_aio_create_completion(s, nbdgo_cb, &c);
	if (r < 0) {
		s->port = s->data = 0;
		return r;
	}
	__atomic_add_fetch(&s->img->inflight, 1, __ATOMIC_ACQ_REL);
	switch (op) {
	case OP_READ:    r = rbd_aio_read(img, off, len, buf, c); break;
	case OP_WRITE:   r = rbd_aio_write(img, off, len, buf, c); break;
	case OP_FLUSH:   r = rbd_aio_flush(img, c); break;
	case OP_DISCARD: r = rbd_aio_discard(img, off, len, c); break;
	case OP_ZEROES:  r = rbd_aio_write_zeroes(img, off, len, c, zero_flags, 0); break;
	default:         r = -EINVAL;
	}
	if (r < 0) {
		__atomic_sub_fetch(&s->img->inflight, 1, __ATOMIC_ACQ_REL);
		rbd_aio_release(c);
		s->port = s->data = 0;
	}
	return r;
}

// nbdgo_aio_read_lend starts a read into a new bufferlist, kept in s->bl
// (see lend.cc), whose completion reports slot s. The slot holds the
// bufferlist before the read starts, so the reaper always finds it.
static int nbdgo_aio_read_lend(void *view, uint64_t off, uint64_t len, struct nbdgo_slot *s) {
	rbd_completion_t c;
	nbdgo_offer(s, NULL, NULL, 0, NULL, 0);
	if ((s->bl = nbdgo_bl_new()) == NULL)
		return -ENOMEM;
	int r = rbd_aio_create_completion(s, nbdgo_cb, &c);
	if (r >= 0) {
		__atomic_add_fetch(&s->img->inflight, 1, __ATOMIC_ACQ_REL);
		r = nbdgo_aio_read_bl(view, off, len, c, s->bl);
		if (r < 0) {
			__atomic_sub_fetch(&s->img->inflight, 1, __ATOMIC_ACQ_REL);
			rbd_aio_release(c);
		}
	}
	if (r < 0) {
		nbdgo_bl_free(s->bl);
		s->bl = NULL;
	}
	return r;
}

// nbdgo_drain moves up to max finished completions into tags/rets.
static int nbdgo_drain(struct nbdgo_img *im, uintptr_t *tags, int64_t *rets, int max) {
	pthread_mutex_lock(&im->mu);
	int n = im->n < max ? im->n : max;
	memcpy(tags, im->tags, n * sizeof *tags);
	memcpy(rets, im->rets, n * sizeof *rets);
	memmove(im->tags, im->tags + n, (im->n - n) * sizeof *tags);
	memmove(im->rets, im->rets + n, (im->n - n) * sizeof *rets);
	im->n -= n;
	__atomic_store_n(&im->queued, (uint32_t)im->n, __ATOMIC_RELEASE);
	if (im->n == 0)
		im->signalled = im->lazy = 0;
	pthread_mutex_unlock(&im->mu);
	return n;
}

// Allocation map: rbd_diff_iterate2 from the image's creation, object
// granularity (cheap with fast-diff), into caller arrays; stops early
// (returning -ERANGE from the callback) when they are full.
struct nbdgo_diff {
	uint64_t *offs, *lens;
	int *exists;
	int n, max;
};

static int nbdgo_diff_cb(uint64_t off, size_t len, int exists, void *arg) {
	struct nbdgo_diff *d = arg;
	if (d->n == d->max)
		return -ERANGE;
	d->offs[d->n] = off;
	d->lens[d->n] = len;
	d->exists[d->n] = exists;
	d->n++;
	return 0;
}

static int nbdgo_allocated(rbd_image_t img, uint64_t off, uint64_t len,
                           uint64_t *offs, uint64_t *lens, int *exists, int max, int *n) {
	struct nbdgo_diff d = { offs, lens, exists, 0, max };
	int r = rbd_diff_iterate2(img, NULL, off, len, 1, 1, nbdgo_diff_cb, &d);
	*n = d.n;
	return r == -ERANGE ? 0 : r;
}

static void nbdgo_update_cb(void *arg) {
	uint64_t one = 1;
	ssize_t r = write((int)(intptr_t)arg, &one, sizeof one);
	(void)r;
}

static int nbdgo_update_watch(rbd_image_t img, uint64_t *handle, int fd) {
	return rbd_update_watch(img, handle, nbdgo_update_cb, (void *)(intptr_t)fd);
}
*/
import "C"

import (
	"sync/atomic"
	"syscall"
	"unsafe"

	"github.com/ceph/go-ceph/rados"
)

const pollBatch = 256

type cImage struct {
	p    C.rbd_image_t
	q    *C.struct_nbdgo_img
	view unsafe.Pointer // C++ view for lent reads (lend.go); nil: copy
}

// cSlot is a slot's C-side identity: the completion callback's argument.
type cSlot = *C.struct_nbdgo_slot

func errnoOf(r C.int) error {
	if r >= 0 {
		return nil
	}
	return syscall.Errno(-r)
}

// rbd_open / rbd_open_read_only on an ioctx go-ceph opened.
func openImage(ioctx *rados.IOContext, name, snap string, readOnly bool) (cImage, error) {
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	var csnap *C.char
	if snap != "" {
		csnap = C.CString(snap)
		defer C.free(unsafe.Pointer(csnap))
	}
	var img C.rbd_image_t
	io := C.rados_ioctx_t(ioctx.Pointer())
	var r C.int
	if readOnly {
		r = C.rbd_open_read_only(io, cname, &img, csnap)
	} else {
		r = C.rbd_open(io, cname, &img, csnap)
	}
	return cImage{p: img}, errnoOf(r)
}

func (i cImage) close() error { return errnoOf(C.rbd_close(i.p)) }

func (i cImage) size() (uint64, error) {
	var s C.uint64_t
	err := errnoOf(C.rbd_get_size(i.p, &s))
	return uint64(s), err
}

// initQueue sets up the completion queue signalled on fd.
func (i *cImage) initQueue(fd int) error {
	if i.q = C.nbdgo_img_new(C.int(fd)); i.q == nil {
		return syscall.ENOMEM
	}
	return nil
}

// freeQueue releases the queue and the slots (no I/O may be in flight).
func (i *cImage) freeQueue(slots []cSlot) {
	for _, s := range slots {
		C.free(unsafe.Pointer(s))
	}
	if i.q != nil {
		C.nbdgo_img_free(i.q)
		i.q = nil
	}
}

func (i cImage) newSlot(tag uint32) cSlot {
	s := C.nbdgo_slot_new(i.q, C.uintptr_t(tag))
	if s == nil {
		panic("rbdio: out of memory")
	}
	return s
}

func (i cImage) updateWatch(fd int) (uint64, error) {
	var h C.uint64_t
	err := errnoOf(C.nbdgo_update_watch(i.p, &h, C.int(fd)))
	return uint64(h), err
}

func (i cImage) updateUnwatch(h uint64) error {
	return errnoOf(C.rbd_update_unwatch(i.p, C.uint64_t(h)))
}

func (i cImage) lockExclusive() error {
	return errnoOf(C.rbd_lock_acquire(i.p, C.RBD_LOCK_MODE_EXCLUSIVE))
}

func (i cImage) lockRelease() error { return errnoOf(C.rbd_lock_release(i.p)) }

const (
	aioRead    = C.OP_READ
	aioWrite   = C.OP_WRITE
	aioFlush   = C.OP_FLUSH
	aioDiscard = C.OP_DISCARD
	aioZeroes  = C.OP_ZEROES

	zeroThick = C.RBD_WRITE_ZEROES_FLAG_THICK_PROVISION
)

// offer is a direct reply the completion callback may send (see
// nbd.Request.DirectReply): hdr, then data (pinned by the caller until
// the slot is reaped), through port. A nil port: no offer.
type offer struct {
	port      unsafe.Pointer
	hdr, data []byte
}

// aio starts op with o offered; buf must stay valid (pinned) until the
// completion is reaped. The returned error means the op never started.
func (i cImage) aio(op int, off, length uint64, buf []byte, zeroFlags int, s cSlot, o offer) error {
	var p *C.char
	if len(buf) > 0 {
		p = (*C.char)(unsafe.Pointer(&buf[0]))
	}
	// Typed, not unsafe.Pointer: cgo would then check the whole object
	// hdr lies in (the nbd.Request, which holds pointers).
	var hdr, data *C.char
	if o.port != nil && len(o.hdr) > 0 {
		hdr = (*C.char)(unsafe.Pointer(&o.hdr[0]))
	}
	if o.port != nil && len(o.data) > 0 {
		data = (*C.char)(unsafe.Pointer(&o.data[0]))
	}
	return errnoOf(C.nbdgo_aio(i.p, C.int(op), C.uint64_t(off), C.uint64_t(length), p,
		C.int(zeroFlags), s, (*C.struct_nbdgo_port)(o.port), hdr, C.uint32_t(len(o.hdr)),
		data, C.uint32_t(len(o.data))))
}

// aioReadLend starts a read of length bytes at off into slot s's
// bufferlist.
func (i cImage) aioReadLend(off, length uint64, s cSlot) error {
	return errnoOf(C.nbdgo_aio_read_lend(i.view, C.uint64_t(off), C.uint64_t(length), s))
}

// sentBit marks, in a drained tag, a completion whose reply the
// callback sent itself.
const sentBit = uintptr(1) << 40

// queued is how many completions wait to be drained, read without the
// queue's lock: a hint, exact only under it.
func (i cImage) queued() uint32 {
	return (*atomic.Uint32)(unsafe.Pointer(&i.q.queued)).Load()
}

// addWaiters counts connections waiting for their requests back: while
// any do, the callback signals every completion.
func (i cImage) addWaiters(n int32) {
	(*atomic.Int32)(unsafe.Pointer(&i.q.waiters)).Add(n)
}

// takeBL hands over the bufferlist of slot s's finished read, if any.
// The one pointer Go stores into a slot: its old and new values are C
// memory, which the write barrier passes over (see nbdgo_offer for why
// a Go pointer there would not be safe).
func takeBL(s cSlot) *C.struct_nbdgo_bl {
	bl := s.bl
	s.bl = nil
	return bl
}

// poll drains finished completions into tags and rets.
func (i cImage) poll(tags *[pollBatch]uintptr, rets *[pollBatch]int64) int {
	return int(C.nbdgo_drain(i.q, (*C.uintptr_t)(unsafe.Pointer(&tags[0])),
		(*C.int64_t)(unsafe.Pointer(&rets[0])), pollBatch))
}

// fastDiff reports whether allocation queries are cheap (object map).
func (i cImage) fastDiff() bool {
	var f C.uint64_t
	if C.rbd_get_features(i.p, &f) < 0 {
		return false
	}
	return f&C.RBD_FEATURE_FAST_DIFF != 0
}

const maxDiffExtents = 512

// allocated lists allocated extents in [off, off+length): object
// granularity, at most maxDiffExtents (the caller reports the rest later).
func (i cImage) allocated(off, length uint64) (offs, lens []uint64, exists []bool, err error) {
	var (
		o, l [maxDiffExtents]C.uint64_t
		e    [maxDiffExtents]C.int
		n    C.int
	)
	r := C.nbdgo_allocated(i.p, C.uint64_t(off), C.uint64_t(length), &o[0], &l[0], &e[0], maxDiffExtents, &n)
	if err := errnoOf(r); err != nil {
		return nil, nil, nil, err
	}
	for k := range int(n) {
		offs = append(offs, uint64(o[k]))
		lens = append(lens, uint64(l[k]))
		exists = append(exists, e[k] != 0)
	}
	return offs, lens, exists, nil
}
