// Package k8snodes tells the CSI controller whether a node runs this
// driver's node plugin, from the node's CSINode object: the kubelet
// lists a driver there once its node plugin registered. It needs only
// `get` on csinodes (storage.k8s.io), which the provisioner's role
// already grants.
package k8snodes

import (
	"context"
	"fmt"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
)

// Getter reads one object; a dynamic client's resource interface is
// one.
type Getter interface {
	Get(ctx context.Context, name string, opts metav1.GetOptions, subresources ...string) (*unstructured.Unstructured, error)
}

// csiNodes is the CSINode resource.
var csiNodes = schema.GroupVersionResource{Group: "storage.k8s.io", Version: "v1", Resource: "csinodes"}

// CSINodes is a NodeRegistry on the Kubernetes API.
type CSINodes struct {
	Nodes  Getter
	Driver string
}

// InCluster returns a CSINodes on the pod's service account, and false
// outside a cluster. It reads CSINodes as unstructured objects: client-go's
// typed clients register every API group's types, which would more than
// double the binary for one field.
func InCluster(driver string) (*CSINodes, bool, error) {
	cfg, err := rest.InClusterConfig()
	if err == rest.ErrNotInCluster {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, fmt.Errorf("kubernetes API: %w", err)
	}
	c, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, false, fmt.Errorf("kubernetes API: %w", err)
	}
	return &CSINodes{Nodes: c.Resource(csiNodes), Driver: driver}, true, nil
}

// NodeExists: the node's CSINode lists the driver.
func (c *CSINodes) NodeExists(ctx context.Context, nodeID string) (bool, error) {
	n, err := c.Nodes.Get(ctx, nodeID, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	drivers, _, err := unstructured.NestedSlice(n.Object, "spec", "drivers")
	if err != nil {
		return false, fmt.Errorf("CSINode %s: %w", nodeID, err)
	}
	for _, d := range drivers {
		if m, ok := d.(map[string]any); ok && m["name"] == c.Driver {
			return true, nil
		}
	}
	return false, nil
}
