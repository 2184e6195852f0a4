package rbdio

// librbd's quiesce watch, used around snapshots. Same rule as aio.go: C
// callbacks only write to a file descriptor; Go reads it.

/*
#cgo LDFLAGS: -lrbd
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <rbd/librbd.h>

static void nbdgo_quiesce_cb(void *arg) {
	char c = 'q';
	ssize_t r = write((int)(intptr_t)arg, &c, 1);
	(void)r;
}

static void nbdgo_unquiesce_cb(void *arg) {
	char c = 'u';
	ssize_t r = write((int)(intptr_t)arg, &c, 1);
	(void)r;
}

static int nbdgo_quiesce_watch(rbd_image_t img, uint64_t *h, int fd) {
	return rbd_quiesce_watch(img, nbdgo_quiesce_cb, nbdgo_unquiesce_cb, (void *)(intptr_t)fd, h);
}

*/
import "C"

import (
	"fmt"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
)

// quiescer relays librbd's quiesce/unquiesce notifications (written by C
// callbacks into a pipe, in order) to a Go hook on one goroutine.
type quiescer struct {
	img    cImage
	handle uint64
	r, w   int
	done   chan struct{}
}

func startQuiesce(img cImage, spec ceph.ImageSpec, hook func(bool) error) (*quiescer, error) {
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
		return nil, err
	}
	q := &quiescer{img: img, r: p[0], w: p[1], done: make(chan struct{})}
	h, err := img.quiesceWatch(q.w)
	if err != nil {
		unix.Close(q.r)
		unix.Close(q.w)
		return nil, fmt.Errorf("image %s: quiesce watch: %w", spec, err)
	}
	q.handle = h
	go q.run(hook)
	return q, nil
}

func (q *quiescer) run(hook func(bool) error) {
	defer close(q.done)
	var b [1]byte
	for {
		n, err := unix.Read(q.r, b[:])
		if err == unix.EINTR {
			continue
		}
		if n != 1 || err != nil {
			return
		}
		switch b[0] {
		case 'q':
			r := 0
			if err := hook(true); err != nil {
				r = -int(syscall.EIO)
			}
			q.img.quiesceComplete(q.handle, r)
		case 'u':
			hook(false)
		}
	}
}

// stop unregisters the watch (no callback runs after it returns), then
// ends the goroutine. A nil quiescer is a no-op.
func (q *quiescer) stop() error {
	if q == nil {
		return nil
	}
	err := q.img.quiesceUnwatch(q.handle)
	unix.Close(q.w)
	<-q.done
	unix.Close(q.r)
	return err
}

// rbd_quiesce_watch: fd gets 'q' on quiesce and 'u' on unquiesce.
func (i cImage) quiesceWatch(fd int) (uint64, error) {
	var h C.uint64_t
	err := errnoOf(C.nbdgo_quiesce_watch(i.p, &h, C.int(fd)))
	return uint64(h), err
}

func (i cImage) quiesceComplete(h uint64, r int) {
	C.rbd_quiesce_complete(i.p, C.uint64_t(h), C.int(r))
}

func (i cImage) quiesceUnwatch(h uint64) error {
	return errnoOf(C.rbd_quiesce_unwatch(i.p, C.uint64_t(h)))
}
