// Package backend turns a device spec from the command line (mem:SIZE,
// file:PATH) into an nbd.Backend. The RBD backend joins it later.
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
)

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
func Open(spec string, readOnly bool) (*Opened, error) {
	kind, arg, ok := strings.Cut(spec, ":")
	if !ok || arg == "" {
		return nil, fmt.Errorf("bad spec %q: want mem:SIZE or file:PATH", spec)
	}
	switch kind {
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
	return nil, fmt.Errorf("bad spec %q: unknown kind %q (want mem or file)", spec, kind)
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
