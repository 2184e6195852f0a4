// Package backend turns a device spec from the command line into an
// nbd.Backend: an RBD image ([rbd:]pool/[ns/]image[@snap]), mem:SIZE or
// file:PATH.
package backend

import (
	"errors"
	"fmt"
	"runtime"

	"github.com/rbd-nbd-go/rbd-nbd-go/backend/filedev"
	"github.com/rbd-nbd-go/rbd-nbd-go/backend/mem"
	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
	"github.com/rbd-nbd-go/rbd-nbd-go/devspec"
	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
	"github.com/rbd-nbd-go/rbd-nbd-go/rbdio"
)

// Options apply to whatever the spec names.
type Options struct {
	ReadOnly  bool
	Exclusive bool // RBD only: take and keep the exclusive lock
	// Deferred leaves an RBD image's exclusive lock and quiesce watch
	// to Opened.Activate (see rbdio.OpenOptions).
	Deferred bool
	Ceph     ceph.Options
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
	activate func() error
	release  func() error
}

// NewOpened wraps a backend opened elsewhere, with what finishes a
// Deferred open (activate) and what lets it go (close); either may be
// nil. Open makes every Opened a daemon serves; this is for callers
// that stand in for it, as tests do.
func NewOpened(b nbd.Backend, describe string, activate, close func() error) *Opened {
	return &Opened{Backend: b, Describe: describe, activate: activate, close: close}
}

// Activate finishes an Open with Deferred (the lock, the quiesce watch);
// otherwise it does nothing.
func (o *Opened) Activate() error {
	if o.activate == nil {
		return nil
	}
	return o.activate()
}

// ReleaseLock lets go of the exclusive lock ahead of Close (a handover:
// see rbdio.Image.ReleaseLock); false if the backend holds none it can
// release early, and then only Close lets go.
func (o *Opened) ReleaseLock() (bool, error) {
	if o.release == nil {
		return false, nil
	}
	return true, o.release()
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
	sp, err := devspec.Parse(spec)
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
			ReadOnly: readOnly, Exclusive: o.Exclusive, Deferred: o.Deferred, OnResize: o.OnResize,
			Encryption: o.Encryption, OnQuiesce: o.OnQuiesce})
		if err != nil {
			return nil, err
		}
		return &Opened{Backend: im, Describe: "rbd " + is.String(), close: im.Close, activate: im.Activate,
			release: im.ReleaseLock}, nil
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
