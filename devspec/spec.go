// Package devspec parses device specs, the name of what a device serves:
// an RBD image ([rbd:]pool/[ns/]image[@snap]), mem:SIZE or file:PATH.
// It has no cgo, so every client of the node daemon (the CLI, the CSI
// driver) checks a spec before anything is opened.
package devspec

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
)

// Spec is a parsed device spec. Every component that needs to know what a
// spec names (the CLI before it contacts the daemon, list-mapped, the
// daemon matching targets) goes through Parse.
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

// Parse checks a spec's syntax without opening anything. A spec
// without "kind:" is an RBD image.
func Parse(spec string) (Spec, error) {
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
