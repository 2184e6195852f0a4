package rbdio

import (
	"fmt"

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
}

// OpenSync opens spec read-write through go-ceph.
func OpenSync(clusters *Clusters, o ceph.Options, spec ceph.ImageSpec) (*SyncImage, error) {
	ioctx, release, err := clusters.ioctx(o, spec)
	if err != nil {
		return nil, err
	}
	img, err := rbd.OpenImage(ioctx, spec.Image, spec.Snap)
	if err == nil {
		var size uint64
		if size, err = img.GetSize(); err == nil {
			return &SyncImage{img: img, size: size, release: release}, nil
		}
		img.Close()
	}
	release()
	return nil, fmt.Errorf("open image %s: %w", spec, err)
}

func (s *SyncImage) Size() uint64                             { return s.size }
func (s *SyncImage) ReadAt(p []byte, off int64) (int, error)  { return s.img.ReadAt(p, off) }
func (s *SyncImage) WriteAt(p []byte, off int64) (int, error) { return s.img.WriteAt(p, off) }
func (s *SyncImage) Flush() error                             { return s.img.Flush() }
func (s *SyncImage) Trim(off, n int64) error {
	_, err := s.img.Discard(uint64(off), uint64(n))
	return err
}

func (s *SyncImage) Close() error {
	err := s.img.Close()
	s.release()
	return err
}
