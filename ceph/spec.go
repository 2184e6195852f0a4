package ceph

import (
	"fmt"
	"strings"
)

// ImageSpec names an image the way the rbd tool does:
// [pool/[namespace/]]image[@snap], pool defaulting to "rbd".
type ImageSpec struct {
	Pool, Namespace, Image, Snap string
}

// ParseImageSpec parses s, refusing empty components and separators that
// Ceph does not allow in names.
func ParseImageSpec(s string) (ImageSpec, error) {
	var sp ImageSpec
	rest := s
	if i := strings.IndexByte(rest, '@'); i >= 0 {
		rest, sp.Snap = rest[:i], rest[i+1:]
		if sp.Snap == "" || strings.ContainsAny(sp.Snap, "/@") {
			return sp, fmt.Errorf("bad image spec %q: bad snapshot name", s)
		}
	}
	parts := strings.Split(rest, "/")
	switch len(parts) {
	case 1:
		sp.Pool, sp.Image = "rbd", parts[0]
	case 2:
		sp.Pool, sp.Image = parts[0], parts[1]
	case 3:
		sp.Pool, sp.Namespace, sp.Image = parts[0], parts[1], parts[2]
		if sp.Namespace == "" {
			return sp, fmt.Errorf("bad image spec %q: empty namespace", s)
		}
	default:
		return sp, fmt.Errorf("bad image spec %q: want [pool/[namespace/]]image[@snap]", s)
	}
	if sp.Pool == "" || sp.Image == "" {
		return sp, fmt.Errorf("bad image spec %q: want [pool/[namespace/]]image[@snap]", s)
	}
	return sp, nil
}

func (s ImageSpec) String() string {
	out := s.Pool + "/"
	if s.Namespace != "" {
		out += s.Namespace + "/"
	}
	out += s.Image
	if s.Snap != "" {
		out += "@" + s.Snap
	}
	return out
}
