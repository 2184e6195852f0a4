// Package filedev serves a regular file or a block device with positioned
// I/O, using the kernel's own primitives for everything NBD can ask:
// fallocate for trim and zeroes, fdatasync and RWF_DSYNC for durability,
// SEEK_DATA/SEEK_HOLE for block status, fadvise for cache.
package filedev

import (
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"

	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
)

// Device is one open file or block device.
type Device struct {
	f        *os.File
	fd       int
	size     uint64
	readOnly bool
	blockDev bool
}

// Open opens path. A regular file keeps its current size; a block device
// reports its own.
func Open(path string, readOnly bool) (*Device, error) {
	flag := os.O_RDWR
	if readOnly {
		flag = os.O_RDONLY
	}
	f, err := os.OpenFile(path, flag, 0)
	if err != nil {
		return nil, err
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	d := &Device{f: f, fd: int(f.Fd()), readOnly: readOnly}
	switch m := fi.Mode(); {
	case m.IsRegular():
		d.size = uint64(fi.Size())
	case m&os.ModeDevice != 0 && m&os.ModeCharDevice == 0:
		end, err := f.Seek(0, io.SeekEnd)
		if err != nil {
			f.Close()
			return nil, fmt.Errorf("%s: size of block device: %w", path, err)
		}
		d.size, d.blockDev = uint64(end), true
	default:
		f.Close()
		return nil, fmt.Errorf("%s: not a regular file or block device", path)
	}
	return d, nil
}

func (d *Device) Size() uint64   { return d.size }
func (d *Device) ReadOnly() bool { return d.readOnly }
func (d *Device) Close() error   { return d.f.Close() }

func (d *Device) ReadAt(p []byte, off int64) (int, error) {
	n, err := d.f.ReadAt(p, off)
	if err == io.EOF && n < len(p) {
		// Shrunk under us: reading past the end is an I/O error for the
		// client, not a short read it cannot express.
		return n, fmt.Errorf("read at %d: file is shorter than the export: %w", off, nbd.ErrIO)
	}
	return n, err
}

func (d *Device) WriteAt(p []byte, off int64) (int, error) {
	return d.f.WriteAt(p, off)
}

// Flush: fdatasync covers every write completed on any connection, since
// all share this descriptor.
func (d *Device) Flush() error { return ignoreEINTR(func() error { return unix.Fdatasync(d.fd) }) }

// WriteAtFUA writes with RWF_DSYNC: durable on return, without flushing
// unrelated dirty data the way a full fdatasync would.
func (d *Device) WriteAtFUA(p []byte, off int64) error {
	for len(p) > 0 {
		n, err := unix.Pwritev2(d.fd, [][]byte{p}, off, unix.RWF_DSYNC)
		if errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENOSYS) {
			if _, err := d.f.WriteAt(p, off); err != nil {
				return err
			}
			return d.Flush()
		}
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		p, off = p[n:], off+int64(n)
	}
	return nil
}

// Trim punches a hole; when the filesystem or device cannot, the hint is
// dropped, which TRIM allows.
func (d *Device) Trim(off, n int64) error {
	err := d.fallocate(unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, n)
	if notSupported(err) {
		return nil
	}
	return err
}

// Zero tries, in order: punching a hole (unless noHole), ZERO_RANGE, and
// finally writing zeroes, which FAST_ZERO forbids.
func (d *Device) Zero(off, n int64, noHole, fast bool) error {
	if !noHole {
		err := d.fallocate(unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, n)
		if !notSupported(err) {
			return err
		}
	}
	err := d.fallocate(unix.FALLOC_FL_ZERO_RANGE|unix.FALLOC_FL_KEEP_SIZE, off, n)
	if !notSupported(err) {
		return err
	}
	if fast {
		return nbd.ErrNotSupported
	}
	return nbd.WriteZeroes(d.f, off, n)
}

func (d *Device) fallocate(mode uint32, off, n int64) error {
	if d.readOnly {
		return nbd.ErrPerm
	}
	return ignoreEINTR(func() error { return unix.Fallocate(d.fd, mode, off, n) })
}

// Cache starts readahead of the range into the page cache.
func (d *Device) Cache(off, n int64) error {
	return unix.Fadvise(d.fd, off, n, unix.FADV_WILLNEED)
}

// BlockStatus walks SEEK_DATA/SEEK_HOLE. Block devices and filesystems
// without support report everything as data, which is always correct.
func (d *Device) BlockStatus(off, n int64, dst []nbd.Extent) ([]nbd.Extent, error) {
	end := off + n
	if d.blockDev {
		return append(dst, nbd.Extent{Length: uint32(n)}), nil
	}
	for pos := off; pos < end && len(dst) < 256; {
		data, err := unix.Seek(d.fd, pos, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			data = end // only a hole remains
		} else if err != nil {
			if len(dst) == 0 {
				return append(dst, nbd.Extent{Length: uint32(n)}), nil
			}
			return dst, nil
		}
		if data > pos {
			h := min(data, end) - pos
			dst = append(dst, nbd.Extent{Length: uint32(h), Flags: nbd.StateHole | nbd.StateZero})
			pos += h
			continue
		}
		hole, err := unix.Seek(d.fd, pos, unix.SEEK_HOLE)
		if err != nil {
			hole = end
		}
		l := min(hole, end) - pos
		dst = append(dst, nbd.Extent{Length: uint32(l)})
		pos += l
	}
	return dst, nil
}

func notSupported(err error) bool {
	return errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENOSYS) ||
		errors.Is(err, unix.ENODEV) || errors.Is(err, unix.EINVAL)
}

func ignoreEINTR(f func() error) error {
	for {
		if err := f(); err != unix.EINTR {
			return err
		}
	}
}
