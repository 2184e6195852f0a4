package rbdio

import (
	"fmt"
	"syscall"

	"golang.org/x/sys/unix"
)

// quiescer relays librbd's quiesce/unquiesce notifications (written by C
// callbacks into a pipe, in order) to a Go hook on one goroutine.
type quiescer struct {
	img    cImage
	handle uint64
	r, w   int
	done   chan struct{}
}

func startQuiesce(img cImage, spec ImageSpec, hook func(bool) error) (*quiescer, error) {
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
