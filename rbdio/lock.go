package rbdio

import (
	"errors"
	"fmt"
	"syscall"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
)

// An open's phase: the owner (every open but these two); Deferred,
// until Activate; released, after ReleaseLock. In the other two the
// device is another daemon's: its writes and snapshot quiesces are not
// this open's to handle.
const (
	phaseOwner int32 = iota
	phaseDeferred
	phaseReleased
)

// Activate finishes a Deferred open: it takes the exclusive lock, if the
// open asked for it, and turns the quiesce hook on (its watch was
// registered at open, out of the handover's pause). It does nothing for
// any other open. After an error it may be called again, or the image
// closed.
func (im *Image) Activate() error {
	if im.phase.Load() != phaseDeferred {
		return nil
	}
	im.waitFenced()
	if im.exclusive {
		if err := im.lockExclusive(); err != nil {
			return err
		}
	}
	im.phase.Store(phaseOwner)
	return nil
}

// waitFenced waits until the image's session may write: a dead
// predecessor's sessions fenced (SessionHooks). Open and Activate call
// it before anything that may write or take a lock.
func (im *Image) waitFenced() {
	if im.fenced != nil {
		<-im.fenced
		im.fenced = nil
	}
}

func (im *Image) lockExclusive() error {
	if err := im.img.lockExclusive(); err != nil {
		if errors.Is(err, syscall.EROFS) || errors.Is(err, syscall.EBUSY) {
			return matching{fmt.Errorf("image %s: exclusive lock is held by another client", im.spec), ceph.ErrLocked}
		}
		return fmt.Errorf("image %s: exclusive lock: %w", im.spec, err)
	}
	return nil
}

// ReleaseLock lets go of the exclusive lock ahead of Close. A daemon
// handing its devices over releases every image's lock first and closes
// the images once the new daemon has taken them: the new daemon waits
// only for the lock, not for the rest of a close (two unwatches and
// librbd's teardown, each a round trip to the OSDs). librbd blocks new
// writes and flushes its cache and whatever is in flight before it
// unlocks. From then on, writes and flushes are refused (librbd would
// ask for the lock back), a snapshot's quiesce is acked without the
// hook, and Close must still be called. It does nothing for an open
// that holds no lock of its own.
func (im *Image) ReleaseLock() error {
	if !im.exclusive || !im.phase.CompareAndSwap(phaseOwner, phaseReleased) {
		return nil
	}
	if err := im.img.lockRelease(); err != nil {
		return fmt.Errorf("image %s: release the exclusive lock: %w", im.spec, err)
	}
	return nil
}

// notOwner completes a write or flush r sent to an open that is not the
// owner, and reports whether it did. Before Activate a flush has nothing
// of ours to flush (librbd's would wait for the lock); after the release
// librbd would ask for the lock back, so both are refused.
func (im *Image) notOwner(r *nbd.Request) bool {
	switch im.phase.Load() {
	case phaseDeferred:
		if r.Op == nbd.OpFlush {
			r.Complete(nil)
			return true
		}
	case phaseReleased:
		r.Complete(nbd.ErrShutdown)
		return true
	}
	return false
}

// quiesceHook is the quiesce handler the watch calls: the open's own
// while the device is this daemon's, from Activate (of a Deferred open)
// until its lock is released. Outside that the device is another
// daemon's, which runs its own, and a quiesce is acked at once; but an
// unquiesce always follows a quiesce passed on. Only the quiescer's
// goroutine calls it.
func (im *Image) quiesceHook() func(bool) error {
	var frozen bool
	return func(q bool) error {
		if im.phase.Load() != phaseOwner && (q || !frozen) {
			return nil
		}
		frozen = q
		return im.onQuiesce(q)
	}
}
