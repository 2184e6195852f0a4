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
	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
	"github.com/rbd-nbd-go/rbd-nbd-go/rbdio"
)

// Options apply to whatever the spec names.
type Options struct {
	ReadOnly  bool
	Exclusive bool // RBD only: take and keep the exclusive lock
	Ceph      ceph.Options
	// Clusters shares RADOS connections between images; required for
	// RBD specs.
	Clusters *rbdio.Clusters
	// OnResize is told the new size when the image grows or shrinks.
	OnResize func(size uint64)
	// Encryption and OnQuiesce apply to RBD images (see rbdio.OpenOptions).
	Encryption ceph.Encryption
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

// Spec is a parsed device spec. Every component that needs to know what a
// spec names (the CLI before it contacts the daemon, list-mapped, the
// daemon matching targets) goes through ParseSpec.
type Spec struct {
	Kind  string         // rbd, rbd-sync, mem or file
	Arg   string         // what follows "kind:"
	Image ceph.ImageSpec // for rbd and rbd-sync
	Size  uint64         // for mem
}

// IsRBD reports whether the spec names an RBD image.
func (s Spec) IsRBD() bool { return s.Kind == "rbd" || s.Kind == "rbd-sync" }

// String is the canonical form: "pool/image" and "rbd:rbd/image" compare
// equal as Ceph would have them.
func (s Spec) String() string {
	if s.Kind == "rbd" {
		return s.Image.String()
	}
	return s.Kind + ":" + s.Arg
}

// ParseSpec checks a spec's syntax without opening anything. A spec
// without "kind:" is an RBD image.
func ParseSpec(spec string) (Spec, error) {
	kind, arg, ok := strings.Cut(spec, ":")
	if !ok {
		kind, arg = "rbd", spec
	}
	s := Spec{Kind: kind, Arg: arg}
	if arg == "" {
		return s, fmt.Errorf("bad spec %q: want [rbd:]pool/image, mem:SIZE or file:PATH", spec)
	}
	var err error
	switch kind {
	case "rbd", "rbd-sync":
		s.Image, err = ceph.ParseImageSpec(arg)
	case "mem":
		if s.Size, err = ParseSize(arg); err != nil {
			err = fmt.Errorf("bad spec %q: %w", spec, err)
		}
	case "file":
	default:
		err = fmt.Errorf("bad spec %q: unknown kind %q (want rbd, mem or file)", spec, kind)
	}
	return s, err
}

// Open parses spec and opens it.
func Open(spec string, o Options) (*Opened, error) {
	readOnly := o.ReadOnly
	sp, err := ParseSpec(spec)
	if err != nil {
		return nil, err
	}
	if !sp.IsRBD() && (o.Exclusive || o.Encryption.Format != "") {
		return nil, fmt.Errorf("--exclusive and encryption apply to RBD images only")
	}
	if sp.IsRBD() && o.Clusters == nil {
		return nil, errors.New("rbd spec without a cluster registry")
	}
	is, arg := sp.Image, sp.Arg
	switch sp.Kind {
	case "rbd":
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
		im, err := rbdio.OpenSync(o.Clusters, o.Ceph, is)
		if err != nil {
			return nil, err
		}
		p := nbd.NewPool(im, 128)
		return &Opened{Backend: p, Describe: "rbd (go-ceph sync) " + is.String(), close: func() error {
			return errors.Join(p.Close(), im.Close())
		}}, nil
	case "mem":
		// Copies under 128 KiB run inline; larger ones on two workers,
		// so a 1 MiB write's copy overlaps reading the next payload.
		p := nbd.NewHybrid(mem.New(sp.Size, readOnly), 2, 128<<10)
		return &Opened{Backend: p, Describe: "memory " + arg, close: p.Close}, nil
	default: // file
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
