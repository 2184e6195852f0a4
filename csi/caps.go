package csi

import (
	"errors"
	"fmt"

	"github.com/container-storage-interface/spec/lib/go/csi"
)

// errBadCapability: a volume capability this driver cannot honour.
var errBadCapability = errors.New("unsupported volume capability")

// access is what a volume capability asks of a device.
type access struct {
	Block      bool
	FsType     string // ext4 or xfs, for mounts
	MountFlags []string
	// ReadOnly maps the image read-only (reader-only modes).
	ReadOnly bool
	// Exclusive maps with the RBD exclusive lock: single-node modes that
	// write, so two nodes can never write the image even if
	// Kubernetes' own attach guard is bypassed.
	Exclusive bool
	// SingleWriter allows one publish (SINGLE_NODE_SINGLE_WRITER).
	SingleWriter bool
}

// fsSupported: the filesystems NodeStage formats and mounts.
func fsSupported(fs string) bool { return fs == "ext4" || fs == "xfs" }

func parseCapability(c *csi.VolumeCapability) (access, error) {
	var a access
	if c == nil || c.GetAccessMode() == nil {
		return a, fmt.Errorf("%w: no access mode", errBadCapability)
	}
	switch {
	case c.GetBlock() != nil:
		a.Block = true
	case c.GetMount() != nil:
		a.FsType = c.GetMount().GetFsType()
		if a.FsType == "" {
			a.FsType = "ext4"
		}
		if !fsSupported(a.FsType) {
			return a, fmt.Errorf("%w: filesystem %q (want ext4 or xfs)", errBadCapability, a.FsType)
		}
		a.MountFlags = c.GetMount().GetMountFlags()
	default:
		return a, fmt.Errorf("%w: neither block nor mount access", errBadCapability)
	}
	switch m := c.GetAccessMode().GetMode(); m {
	case csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER:
		a.Exclusive = true
	case csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER:
		a.Exclusive, a.SingleWriter = true, true
	case csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY,
		csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY:
		a.ReadOnly = true
	case csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER:
		// Shared raw block only: no filesystem survives two nodes
		// mounting it read-write. (MULTI_NODE_SINGLE_WRITER is refused:
		// nothing here could keep the other nodes from writing.)
		if !a.Block {
			return a, fmt.Errorf("%w: %s needs block access (no filesystem can be shared by nodes)", errBadCapability, m)
		}
	default:
		return a, fmt.Errorf("%w: access mode %s", errBadCapability, m)
	}
	return a, nil
}

// parseCapabilities checks every capability of a CreateVolume or
// ValidateVolumeCapabilities request.
func parseCapabilities(cs []*csi.VolumeCapability) ([]access, error) {
	if len(cs) == 0 {
		return nil, fmt.Errorf("%w: none given", errBadCapability)
	}
	var out []access
	for _, c := range cs {
		a, err := parseCapability(c)
		if err != nil {
			return nil, err
		}
		out = append(out, a)
	}
	return out, nil
}
