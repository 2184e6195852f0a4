package rbdio

import (
	"fmt"
	"sync/atomic"

	"github.com/ceph/go-ceph/rbd"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
)

// SyncImage is an image served through go-ceph's synchronous calls (one
// blocking rbd_read/rbd_write per request, one OS thread per request in
// flight). It exists as the benchmark's point of comparison for the aio
// path (spec rbd-sync:pool/image), not for production use.
type SyncImage struct {
	img     *rbd.Image
	size    uint64
	release func()
	fenced  <-chan struct{} // the session's fencing (SessionHooks)
	// writable: fenced was seen closed, so a request pays one atomic
	// load, not a channel receive (each takes the channel's lock)
	writable atomic.Bool
}

// OpenSync opens spec read-write through go-ceph. As an Image's, the
// open does not wait for its session's fencing (it may come ahead of a
// handover, before the fencer exists); its first write, trim or flush
// does.
func OpenSync(clusters *Clusters, o ceph.Options, spec ceph.ImageSpec) (*SyncImage, error) {
	ioctx, fenced, release, err := clusters.ioctxOn(o, spec, false)
	if err != nil {
		return nil, err
	}
	img, err := rbd.OpenImage(ioctx, spec.Image, spec.Snap)
	if err == nil {
		var size uint64
		if size, err = img.GetSize(); err == nil {
			return &SyncImage{img: img, size: size, release: release, fenced: fenced}, nil
		}
		img.Close()
	}
	release()
	return nil, fmt.Errorf("open image %s: %w", spec, err)
}

func (s *SyncImage) Size() uint64                            { return s.size }
func (s *SyncImage) ReadAt(p []byte, off int64) (int, error) { return s.img.ReadAt(p, off) }
func (s *SyncImage) WriteAt(p []byte, off int64) (int, error) {
	s.waitFenced()
	return s.img.WriteAt(p, off)
}
func (s *SyncImage) Flush() error { s.waitFenced(); return s.img.Flush() }
func (s *SyncImage) Trim(off, n int64) error {
	s.waitFenced()
	_, err := s.img.Discard(uint64(off), uint64(n))
	return err
}

// waitFenced waits for the session's fencing before the first write;
// after it, only the flag is read.
func (s *SyncImage) waitFenced() {
	if s.fenced != nil && !s.writable.Load() {
		<-s.fenced
		s.writable.Store(true)
	}
}

func (s *SyncImage) Close() error {
	err := s.img.Close()
	s.release()
	return err
}
