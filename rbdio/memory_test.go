package rbdio

import (
	"os"
	"testing"
)

// TestAllocator: C's malloc (librbd's) is jemalloc's, with memory.c's
// settings, and it answers for its memory, so the daemon's `memory given
// back` line can say where the C heap is.
func TestAllocator(t *testing.T) {
	if os.Getenv("MALLOC_CONF") == "" {
		if v, ok := decayMS(); !ok || v != -1 {
			t.Errorf("opt.dirty_decay_ms = %d (answered: %v), want -1 from memory.c's malloc_conf", v, ok)
		}
	}
	allocated := func() uint64 {
		attrs := CMemory()
		for i := 0; i+1 < len(attrs); i += 2 {
			if attrs[i] == "c_allocated_kib" {
				return attrs[i+1].(uint64)
			}
		}
		t.Fatalf("no c_allocated_kib in %v", attrs)
		return 0
	}
	before := allocated()
	free := cAllocate(16 << 20)
	after := allocated()
	free()
	if after < before+15<<10 {
		t.Fatalf("jemalloc counted %d KiB allocated after C's malloc of 16 MiB, %d KiB before: malloc is not jemalloc's", after, before)
	}
	ReleaseFreeMemory()
}
