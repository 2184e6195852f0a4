package csi

import (
	"context"
	"errors"
	"net/url"
	"os"
	"path/filepath"
)

// DirRegistry is a NodeRegistry on a shared directory: every node plugin
// creates a file named after its node ID at start, and the controller
// checks for it. It suits controller and nodes that share a filesystem
// (one host; tests); in Kubernetes the attacher already checks the node's
// CSINode.
type DirRegistry struct{ Dir string }

// Register records nodeID.
func (r DirRegistry) Register(nodeID string) error {
	if err := os.MkdirAll(r.Dir, 0o755); err != nil {
		return err
	}
	return os.WriteFile(r.path(nodeID), nil, 0o644)
}

func (r DirRegistry) NodeExists(_ context.Context, nodeID string) (bool, error) {
	_, err := os.Stat(r.path(nodeID))
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	return err == nil, err
}

func (r DirRegistry) path(nodeID string) string { return filepath.Join(r.Dir, url.PathEscape(nodeID)) }

// SelfRegistry knows one node: its own, when the controller and node
// roles share a process (csi-sanity's rig, a single-host install).
type SelfRegistry struct{ NodeID string }

func (r SelfRegistry) NodeExists(_ context.Context, nodeID string) (bool, error) {
	return nodeID == r.NodeID, nil
}

// AnyRegistry knows a node if any of its registries does: the
// Kubernetes CSINode, the process's own node, a shared directory.
type AnyRegistry []NodeRegistry

func (rs AnyRegistry) NodeExists(ctx context.Context, nodeID string) (bool, error) {
	var errs []error
	for _, r := range rs {
		ok, err := r.NodeExists(ctx, nodeID)
		if ok {
			return true, nil
		}
		if err != nil {
			errs = append(errs, err)
		}
	}
	return false, errors.Join(errs...)
}
