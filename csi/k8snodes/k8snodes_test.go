package k8snodes

import (
	"context"
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic/fake"
)

func csiNode(name string, drivers ...string) *unstructured.Unstructured {
	var ds []any
	for _, d := range drivers {
		ds = append(ds, map[string]any{"name": d, "nodeID": name})
	}
	return &unstructured.Unstructured{Object: map[string]any{"apiVersion": "storage.k8s.io/v1", "kind": "CSINode",
		"metadata": map[string]any{"name": name}, "spec": map[string]any{"drivers": ds}}}
}

func TestNodeExists(t *testing.T) {
	c := fake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(),
		map[schema.GroupVersionResource]string{csiNodes: "CSINodeList"},
		csiNode("ours", "other.csi", "rbd-nbd-go.csi.io"), csiNode("theirs", "other.csi"))
	r := &CSINodes{Nodes: c.Resource(csiNodes), Driver: "rbd-nbd-go.csi.io"}
	for node, want := range map[string]bool{"ours": true, "theirs": false, "missing": false} {
		got, err := r.NodeExists(context.Background(), node)
		if err != nil || got != want {
			t.Errorf("NodeExists(%q) = %v, %v; want %v", node, got, err, want)
		}
	}
	if _, ok, err := InCluster("x"); ok || err != nil {
		t.Fatalf("outside a cluster: %v %v", ok, err)
	}
}
