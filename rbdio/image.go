package rbdio

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
)

// OpenOptions choose how an image is opened.
type OpenOptions struct {
	ReadOnly bool // also implied by a snapshot
	// Exclusive takes the exclusive lock and keeps it: other clients'
	// writes are refused until we close.
	Exclusive bool
	// Deferred opens without the exclusive lock, and with the quiesce
	// hook off: Activate takes the one and turns on the other. A daemon
	// taking devices over opens their images while the old daemon still
	// serves them, so that only the lock changes hands in the pause.
	// (Meanwhile it acks a snapshot's quiesce at once, as a watcher with
	// no handler does: the old daemon's hook is the one that counts.)
	Deferred bool
	// OnResize, if set, is called (from a background goroutine) with
	// the new size after the image is resized.
	OnResize func(size uint64)
	// Encryption loads LUKS encryption right after opening.
	Encryption ceph.Encryption
	// OnQuiesce, if set, is called with true when a snapshot is about to
	// be taken (librbd's quiesce watch) and with false once it is taken.
	// The snapshot waits for the first call; its error fails the snapshot.
	OnQuiesce func(quiesce bool) error
}

// Image serves one RBD image as an nbd.Backend over librbd's aio API.
//
// Each request in flight takes a slot; the slot number is the tag of its
// librbd completion, so no Go pointer crosses into C and the lookup on
// completion is an index. Payload buffers are pinned while librbd holds
// them: librbd reads into and writes from the NBD layer's own buffers,
// with no copy in Go. Large reads on a connection are not even copied by
// librbd: they are lent from its own buffers (lend.go). One goroutine,
// parked on an eventfd librbd signals, reaps completions in batches: no
// goroutine or thread per request. The eventfds are in Go's netpoller, so
// a device whose I/O stopped holds no thread (a goroutine blocked in
// read(2) would hold one for good, and threads are per node what the
// daemon must keep small).
type Image struct {
	spec     ceph.ImageSpec
	img      cImage
	readOnly bool
	fastDiff bool
	size     atomic.Uint64
	onResize func(uint64)

	efd, wfd    int      // completion and update-watch eventfds (non-blocking)
	ef, wf      *os.File // the same, read through the netpoller
	watchHandle uint64
	reaped      chan struct{}
	watched     chan struct{}
	closed      atomic.Bool
	stop        atomic.Bool // set by Close once nothing is in flight: the reaper ends

	mu       sync.Mutex
	idle     sync.Cond
	slots    []*slot
	free     []uint32
	inflight int

	// The reaper's state, shared with Reap (the server's readers and
	// watchdog): whoever holds mu drains the queue and finishes what it
	// finds. gone: the queue is freed.
	reaping struct {
		mu    sync.Mutex
		gone  bool
		tags  [pollBatch]uintptr
		rets  [pollBatch]int64
		batch nbd.Batch
	}

	release func() // cluster connection reference and ioctx
	// fenced closes once the session may write (SessionHooks); nil
	// once waited for, or when there is nothing to wait for.
	fenced <-chan struct{}

	quiesce *quiescer
	// phase: whether this open acts as the image's owner (lock.go);
	// Submit reads it for writes and flushes only.
	phase     atomic.Int32
	exclusive bool
	onQuiesce func(bool) error

	loans  *loanPool
	direct atomic.Uint64 // replies the completion callback sent (tests read it)
}

type slot struct {
	c   cSlot // the completion callback's argument
	r   *nbd.Request
	pin runtime.Pinner
	fua bool // flush still to do before the request completes
}

// Open opens spec on the cluster described by o.
func Open(clusters *Clusters, o ceph.Options, spec ceph.ImageSpec, oo OpenOptions) (*Image, error) {
	ioctx, fenced, release, err := clusters.imageIOCtx(o, spec)
	if err != nil {
		return nil, err
	}
	im := &Image{spec: spec, readOnly: oo.ReadOnly || spec.Snap != "", onResize: oo.OnResize,
		efd: -1, wfd: -1, release: release, fenced: fenced}
	im.idle.L = &im.mu
	if im.img, err = openImage(ioctx, spec.Image, spec.Snap, im.readOnly); err != nil {
		im.release()
		switch {
		case errors.Is(err, syscall.ENOENT) && spec.Snap != "":
			return nil, matching{fmt.Errorf("image %s: image or snapshot does not exist", spec), ceph.ErrImageNotFound}
		case errors.Is(err, syscall.ENOENT):
			return nil, matching{fmt.Errorf("image %s does not exist", spec), ceph.ErrImageNotFound}
		}
		return nil, fmt.Errorf("open image %s: %w", spec, err)
	}
	if err := im.start(oo); err != nil {
		im.img.closeView()
		im.img.close()
		im.img.freeQueue(nil)
		im.closeFDs()
		im.release()
		return nil, err
	}
	return im, nil
}

func (im *Image) start(oo OpenOptions) error {
	if oo.Encryption.Format != "" {
		if err := oo.Encryption.Validate(); err != nil {
			return err
		}
		if err := im.img.loadEncryption(oo.Encryption); err != nil {
			if errors.Is(err, syscall.EPERM) {
				return fmt.Errorf("image %s: %w", im.spec, ceph.ErrBadPassphrase)
			}
			return fmt.Errorf("image %s: load %s encryption (wrong passphrase, or not formatted?): %w",
				im.spec, oo.Encryption.Format, err)
		}
	}
	size, err := im.img.size()
	if err != nil {
		return fmt.Errorf("image %s: size: %w", im.spec, err)
	}
	im.size.Store(size)
	im.fastDiff = im.img.fastDiff()
	im.img.openView()
	im.loans = newLoanPool()
	if !oo.Deferred {
		// What follows may write (librbd takes the lock on a first
		// write); a Deferred open waits in Activate.
		im.waitFenced()
	}
	if oo.Exclusive {
		if im.readOnly {
			return fmt.Errorf("image %s: --exclusive needs a writable image", im.spec)
		}
		if !oo.Deferred {
			if err := im.lockExclusive(); err != nil {
				return err
			}
		}
	}
	if im.efd, err = unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK); err != nil {
		return err
	}
	im.ef = os.NewFile(uintptr(im.efd), "rbd-completions")
	// The reaper waits in the netpoller (RawConn.Read); a file the
	// poller refused would make every request hang, so refuse it here.
	if err := im.ef.SetReadDeadline(time.Time{}); err != nil {
		return fmt.Errorf("image %s: completion eventfd not pollable: %w", im.spec, err)
	}
	if err := im.img.initQueue(im.efd); err != nil {
		return fmt.Errorf("image %s: completion queue: %w", im.spec, err)
	}
	if im.wfd, err = unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK); err != nil {
		return err
	}
	im.wf = os.NewFile(uintptr(im.wfd), "rbd-updates")
	if im.watchHandle, err = im.img.updateWatch(im.wfd); err != nil {
		return fmt.Errorf("image %s: update watch: %w", im.spec, err)
	}
	im.exclusive, im.onQuiesce = oo.Exclusive, oo.OnQuiesce
	if oo.Deferred {
		im.phase.Store(phaseDeferred)
	}
	if oo.OnQuiesce != nil {
		if im.quiesce, err = startQuiesce(im.img, im.spec, im.quiesceHook()); err != nil {
			im.img.updateUnwatch(im.watchHandle)
			return err
		}
	}
	im.reaped, im.watched = make(chan struct{}), make(chan struct{})
	go im.reap()
	go im.watch()
	return nil
}

func (im *Image) Spec() ceph.ImageSpec { return im.spec }
func (im *Image) Size() uint64         { return im.size.Load() }

// Caps: everything librbd does natively. FUA is a write followed by a
// flush of the image (librbd has no per-write durability flag), which
// with the cache off is as cheap as durability gets.
func (im *Image) Caps() nbd.Caps {
	c := nbd.CapFlush | nbd.CapFUA | nbd.CapTrim | nbd.CapZeroes | nbd.CapMultiConn
	if im.readOnly {
		c |= nbd.CapReadOnly
	}
	if im.fastDiff {
		c |= nbd.CapBlockStatus
	}
	return c
}

// Submit starts r on librbd. It never blocks on I/O.
func (im *Image) Submit(r *nbd.Request) {
	// librbd (pacific) accepts a write to a read-only image, or beyond
	// the end of a shrunk one, and never completes it: refuse those here,
	// whatever the layer above checked.
	writes := r.Op == nbd.OpWrite || r.Op == nbd.OpTrim || r.Op == nbd.OpWriteZeroes
	if im.readOnly && writes {
		r.Complete(nbd.ErrPerm)
		return
	}
	if (writes || r.Op == nbd.OpFlush) && im.phase.Load() != phaseOwner && im.notOwner(r) {
		return
	}
	if size := im.size.Load(); r.Op != nbd.OpFlush && (r.Offset > size || uint64(r.Length) > size-r.Offset) {
		if writes {
			r.Complete(nbd.ErrNoSpace)
		} else {
			r.Complete(nbd.ErrInvalid)
		}
		return
	}
	if r.Op == nbd.OpBlockStatus {
		// rbd_diff_iterate2 is synchronous: keep it off the caller's
		// goroutine. Rare, and cheap with fast-diff.
		go im.blockStatus(r)
		return
	}
	lend := r.Op == nbd.OpRead && r.Length >= lendMin && im.img.view != nil && r.CanLend()
	tag, cs, o := im.take(r, !lend)
	var err error
	if lend {
		err = im.img.aioReadLend(r.Offset, uint64(r.Length), cs)
	} else if op, zf, ok := aioOp(r); ok {
		err = im.img.aio(op, r.Offset, uint64(r.Length), r.Data, zf, cs, o)
	} else {
		err = syscall.EINVAL
	}
	if err != nil {
		im.finish(tag, -int64(err.(syscall.Errno)), false, nil)
	}
}

// aioOp is the C layer's operation (and write-zeroes flags) for r.
func aioOp(r *nbd.Request) (op, zeroFlags int, ok bool) {
	switch r.Op {
	case nbd.OpRead:
		return aioRead, 0, true
	case nbd.OpWrite:
		return aioWrite, 0, true
	case nbd.OpFlush:
		return aioFlush, 0, true
	case nbd.OpTrim:
		return aioDiscard, 0, true
	case nbd.OpWriteZeroes:
		if r.Flags&nbd.ReqNoHole != 0 {
			return aioZeroes, zeroThick, true
		}
		return aioZeroes, 0, true
	}
	return 0, 0, false
}

// take assigns r a slot, pinning r.Data if librbd is to use it (a lent
// read's data never passes through r.Data). Slot fields change only under
// im.mu: the reaper reads them after a hand-over through librbd that Go
// cannot see.
func (im *Image) take(r *nbd.Request, pin bool) (uint32, cSlot, offer) {
	im.mu.Lock()
	defer im.mu.Unlock()
	if len(im.free) == 0 {
		tag := uint32(len(im.slots))
		im.slots = append(im.slots, &slot{c: im.img.newSlot(tag)})
		im.free = append(im.free, tag)
	}
	tag := im.free[len(im.free)-1]
	im.free = im.free[:len(im.free)-1]
	im.inflight++
	s := im.slots[tag]
	s.r = r
	s.fua = r.Flags&nbd.ReqFUA != 0
	if pin && len(r.Data) > 0 {
		s.pin.Pin(&r.Data[0])
	}
	// A direct reply only when librbd's completion finishes the request:
	// not a FUA write (its flush follows), not a lent read.
	var o offer
	if pin && !s.fua {
		var ok bool
		if o.port, o.hdr, ok = r.DirectReply(); ok && r.Op == nbd.OpRead {
			o.data = r.Data
		}
	}
	return tag, s.c, o
}

// reap waits for librbd's signal and finishes completions in batches.
//
// It never reads the eventfd: the C callback writes it when Go is
// needed, every write is an edge for Go's (edge-triggered) netpoller
// whatever the counter holds, and the queue itself says whether there
// is work. So a wake-up costs no system call of its own, where reading
// the counter cost two (the read, and the read that finds it empty
// before the goroutine parks). The queue is looked at inside
// RawConn.Read's callback, after the poller was armed: a completion
// queued before that is found there, one after it by the poller.
//
// Completions the callback answered itself are not signalled one by
// one (see aio.go): the server reaps them through Reap, and the
// callback signals when the image has nothing left in flight, so none
// waits for long.
func (im *Image) reap() {
	defer close(im.reaped)
	rc, err := im.ef.SyscallConn()
	if err != nil {
		panic("rbdio: eventfd: " + err.Error()) // an *os.File always has one
	}
	ready := func(uintptr) bool { return im.img.queued() > 0 || im.stop.Load() }
	for {
		if err := rc.Read(ready); err != nil {
			return
		}
		im.reapAll()
		if im.stop.Load() {
			return
		}
	}
}

// Reap finishes completions queued (nbd.Reaper): one batch, and none if
// the reaper or another connection is at it.
//
// The queue is looked at only under the lock, after gone: the watchdog
// may call this for a connection that has just ended, and its image
// may be closed, its queue freed.
func (im *Image) Reap() {
	rs := &im.reaping
	if !rs.mu.TryLock() {
		return
	}
	if !rs.gone && im.img.queued() > 0 {
		im.reapBatch()
	}
	rs.mu.Unlock()
}

// Waiting (nbd.Reaper): a connection waits for its requests back. Until
// it stops, the callback signals every completion, so none of them is
// held back; those queued before, reap now.
func (im *Image) Waiting(on bool) {
	rs := &im.reaping
	rs.mu.Lock()
	defer rs.mu.Unlock()
	if rs.gone {
		return
	}
	if !on {
		im.img.addWaiters(-1)
		return
	}
	im.img.addWaiters(1)
	for im.img.queued() > 0 {
		im.reapBatch()
	}
}

// reapAll finishes every completion queued: what a signal asked for.
func (im *Image) reapAll() {
	rs := &im.reaping
	rs.mu.Lock()
	defer rs.mu.Unlock()
	for !rs.gone && im.img.queued() > 0 {
		im.reapBatch()
	}
}

// reapBatch drains up to pollBatch completions and finishes them;
// replies go out from here, one send per connection per batch, without
// waking each connection's writer (reaping.mu held).
func (im *Image) reapBatch() {
	rs := &im.reaping
	n := im.img.poll(&rs.tags, &rs.rets)
	for i := range n {
		im.finish(uint32(rs.tags[i]), rs.rets[i], rs.tags[i]&sentBit != 0, &rs.batch)
	}
	rs.batch.Flush()
}

// finish completes the request in slot tag with librbd's return value,
// first chaining the flush a FUA write still owes; sent: the callback
// sent its reply.
func (im *Image) finish(tag uint32, ret int64, sent bool, batch *nbd.Batch) {
	im.mu.Lock()
	s := im.slots[tag]
	if ret >= 0 && s.fua {
		s.fua = false
		im.mu.Unlock()
		err := im.img.aio(aioFlush, 0, 0, nil, 0, s.c, offer{})
		if err == nil {
			return
		}
		ret = -int64(err.(syscall.Errno))
		im.mu.Lock()
	}
	r := s.r
	s.r = nil
	s.pin.Unpin()
	bl := takeBL(s.c)
	im.free = append(im.free, tag)
	if im.inflight--; im.inflight == 0 {
		im.idle.Broadcast()
	}
	im.mu.Unlock()
	var err error
	if ret < 0 {
		err = syscall.Errno(-ret)
	}
	if bl != nil {
		if err == nil {
			lendOrCopy(r, bl, im.loans)
		} else {
			freeBL(bl)
		}
	}
	switch {
	case sent:
		im.direct.Add(1)
		r.Sent()
	case batch != nil:
		batch.Complete(r, err)
	default:
		r.Complete(err)
	}
}

// watch follows image updates (resize) through the update-watch eventfd.
func (im *Image) watch() {
	defer close(im.watched)
	var buf [8]byte
	for {
		if _, err := im.wf.Read(buf[:]); err != nil {
			return
		}
		if im.closed.Load() {
			return
		}
		size, err := im.img.size()
		if err != nil || size == im.size.Load() {
			continue
		}
		im.size.Store(size)
		if im.onResize != nil {
			im.onResize(size)
		}
	}
}

// closeWait bounds how long Close waits for requests in flight.
const closeWait = 60 * time.Second

// Close waits for requests in flight (at most closeWait: a completion
// librbd never delivers must not hang shutdown), stops the goroutines
// and closes the image. No Submit may follow.
func (im *Image) Close() error {
	if im.closed.Swap(true) {
		return nil
	}
	timer := time.AfterFunc(closeWait, func() {
		im.mu.Lock()
		im.idle.Broadcast()
		im.mu.Unlock()
	})
	deadline := time.Now().Add(closeWait)
	im.mu.Lock()
	for im.inflight > 0 && time.Now().Before(deadline) {
		im.idle.Wait()
	}
	stuck := im.inflight
	im.mu.Unlock()
	timer.Stop()
	if stuck > 0 {
		// The image cannot be closed safely with aio outstanding; leak
		// it rather than crash, and say so.
		return fmt.Errorf("image %s: %d requests never completed; image left open", im.spec, stuck)
	}
	im.stop.Store(true)
	one := []byte{1, 0, 0, 0, 0, 0, 0, 0}
	unix.Write(im.efd, one)
	unix.Write(im.wfd, one)
	<-im.reaped
	<-im.watched
	im.reaping.mu.Lock()
	im.reaping.gone = true // the server may still call Reap
	im.reaping.mu.Unlock()
	err := im.quiesce.stop()
	err = errors.Join(err, im.img.updateUnwatch(im.watchHandle))
	im.img.closeView()
	err = errors.Join(err, im.img.close())
	cs := make([]cSlot, len(im.slots))
	for i, s := range im.slots {
		cs[i] = s.c
	}
	im.img.freeQueue(cs)
	im.closeFDs()
	im.release()
	return err
}

func (im *Image) closeFDs() {
	for _, f := range []*os.File{im.ef, im.wf} {
		if f != nil {
			f.Close()
		}
	}
}

// blockStatus answers BLOCK_STATUS from the allocation map: allocated
// objects are data, the gaps between them holes that read as zeroes.
func (im *Image) blockStatus(r *nbd.Request) {
	offs, lens, exists, err := im.img.allocated(r.Offset, uint64(r.Length))
	if err != nil {
		r.Complete(err)
		return
	}
	pos, end := r.Offset, r.Offset+uint64(r.Length)
	add := func(to uint64, flags uint32) {
		if to > end {
			to = end
		}
		if to > pos {
			r.Extents = append(r.Extents, nbd.Extent{Length: uint32(to - pos), Flags: flags})
			pos = to
		}
	}
	for k := range offs {
		add(offs[k], nbd.StateHole|nbd.StateZero)
		var f uint32
		if !exists[k] {
			f = nbd.StateHole | nbd.StateZero
		}
		add(offs[k]+lens[k], f)
	}
	if len(offs) < maxDiffExtents {
		add(end, nbd.StateHole|nbd.StateZero) // nothing allocated after the last extent
	}
	r.Complete(nil)
}
