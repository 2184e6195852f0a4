package rbdio

import "testing"

// TestCMemory: the allocator librbd runs on answers for its memory, so
// the daemon's `memory given back` line can say where the C heap is
// (and the binary really runs on the allocator it links).
func TestCMemory(t *testing.T) {
	ReleaseFreeMemory()
	attrs := CMemory()
	if len(attrs) == 0 || len(attrs)%2 != 0 {
		t.Fatalf("CMemory() = %v", attrs)
	}
	got := map[any]any{}
	for i := 0; i < len(attrs); i += 2 {
		got[attrs[i]] = attrs[i+1]
	}
	if v, ok := got["c_allocated_kib"].(uint64); !ok || v == 0 {
		t.Fatalf("no allocated bytes reported: %v", attrs)
	}
}
