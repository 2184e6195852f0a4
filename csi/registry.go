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
