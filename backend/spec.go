// Package backend turns a device spec from the command line into an
// nbd.Backend: an RBD image ([rbd:]pool/[ns/]image[@snap]), mem:SIZE or
// file:PATH.
package backend

import (
	"errors"
	"fmt"
	"runtime"
	"strconv"
	"strings"

	"github.com/rbd-nbd-go/rbd-nbd-go/backend/filedev"
	"github.com/rbd-nbd-go/rbd-nbd-go/backend/mem"
	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
	"github.com/rbd-nbd-go/rbd-nbd-go/rbdio"
)

// Options apply to whatever the spec names.
type Options struct {
	ReadOnly  bool
	Exclusive bool // RBD only: take and keep the exclusive lock
	Ceph      rbdio.Options
	// Clusters shares RADOS connections between images; required for
	// RBD specs.
	Clusters *rbdio.Clusters
	// OnResize is told the new size when the image grows or shrinks.
	OnResize func(size uint64)
	// Encryption and OnQuiesce apply to RBD images (see rbdio.OpenOptions).
	Encryption rbdio.Encryption
	OnQuiesce  func(quiesce bool) error
}

// Opened is a ready backend and how to let it go.
type Opened struct {
	Backend nbd.Backend
	// Describe is a human description for NBD_INFO_DESCRIPTION and logs.
	Describe string
	close    func() error
}

// Close releases the backend (after its server has stopped).
func (o *Opened) Close() error {
	if o.close == nil {
		return nil
	}
	return o.close()
}

// Open parses spec and opens it.
func Open(spec string, o Options) (*Opened, error) {
	readOnly := o.ReadOnly
	kind, arg, ok := strings.Cut(spec, ":")
	if !ok {
		kind, arg = "rbd", spec
	}
	if arg == "" {
		return nil, fmt.Errorf("bad spec %q: want [rbd:]pool/image, mem:SIZE or file:PATH", spec)
	}
	if kind != "rbd" && (o.Exclusive || o.Encryption.Format != "") {
		return nil, fmt.Errorf("--exclusive and encryption apply to RBD images only")
	}
	switch kind {
	case "rbd":
		is, err := rbdSpec(arg, o)
		if err != nil {
			return nil, err
		}
		im, err := rbdio.Open(o.Clusters, o.Ceph, is, rbdio.OpenOptions{
			ReadOnly: readOnly, Exclusive: o.Exclusive, OnResize: o.OnResize,
			Encryption: o.Encryption, OnQuiesce: o.OnQuiesce})
		if err != nil {
			return nil, err
		}
		return &Opened{Backend: im, Describe: "rbd " + is.String(), close: im.Close}, nil
	case "rbd-sync":
		// go-ceph's blocking calls on a worker pool: the bench's baseline
		// for what the aio path buys. One worker per request in flight,
		// as a goroutine-per-request design would have.
		is, err := rbdSpec(arg, o)
		if err != nil {
			return nil, err
		}
		im, err := rbdio.OpenSync(o.Clusters, o.Ceph, is)
		if err != nil {
			return nil, err
		}
		p := nbd.NewPool(im, 128)
		return &Opened{Backend: p, Describe: "rbd (go-ceph sync) " + is.String(), close: func() error {
			return errors.Join(p.Close(), im.Close())
		}}, nil
	case "mem":
		size, err := ParseSize(arg)
		if err != nil {
			return nil, fmt.Errorf("bad spec %q: %w", spec, err)
		}
		// Copies under 128 KiB run inline; larger ones on two workers,
		// so a 1 MiB write's copy overlaps reading the next payload.
		p := nbd.NewHybrid(mem.New(size, readOnly), 2, 128<<10)
		return &Opened{Backend: p, Describe: "memory " + arg, close: p.Close}, nil
	case "file":
		d, err := filedev.Open(arg, readOnly)
		if err != nil {
			return nil, err
		}
		// Enough workers to keep a disk's queue busy; the pool bounds
		// the threads blocked in pread/pwrite.
		p := nbd.NewPool(d, max(8, 4*runtime.GOMAXPROCS(0)))
		return &Opened{Backend: p, Describe: "file " + arg, close: func() error {
			return errors.Join(p.Close(), d.Close())
		}}, nil
	}
	return nil, fmt.Errorf("bad spec %q: unknown kind %q (want rbd, mem or file)", spec, kind)
}

func rbdSpec(arg string, o Options) (rbdio.ImageSpec, error) {
	is, err := rbdio.ParseImageSpec(arg)
	if err == nil && o.Clusters == nil {
		err = errors.New("rbd spec without a cluster registry")
	}
	return is, err
}

// ParseSize reads sizes like 4096, 512K, 64M, 1G, 2T, 1GiB (binary units).
func ParseSize(s string) (uint64, error) {
	t := strings.TrimSuffix(strings.TrimSuffix(strings.ToUpper(s), "IB"), "B")
	shift := 0
	if t != "" {
		switch t[len(t)-1] {
		case 'K':
			shift = 10
		case 'M':
			shift = 20
		case 'G':
			shift = 30
		case 'T':
			shift = 40
		case 'P':
			shift = 50
		}
		if shift > 0 {
			t = t[:len(t)-1]
		}
	}
	n, err := strconv.ParseUint(t, 10, 64)
	if err != nil || n == 0 {
		return 0, fmt.Errorf("bad size %q", s)
	}
	if n > (1<<63-1)>>shift {
		return 0, fmt.Errorf("size %q is too large", s)
	}
	return n << shift, nil
}
