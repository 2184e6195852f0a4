package rbdio

/*
#cgo LDFLAGS: -l:libtcmalloc_minimal.so.4
#include <stddef.h>
#include <stdlib.h>
void MallocExtension_ReleaseFreeMemory(void);
int MallocExtension_GetNumericProperty(const char* property, size_t* value);
*/
import "C"

import "unsafe"

// ReleaseFreeMemory hands tcmalloc's free pages back to the system:
// librbd's and librados' heap, which stays at its peak after images
// close until something asks (MallocExtension::ReleaseFreeMemory).
func ReleaseFreeMemory() { C.MallocExtension_ReleaseFreeMemory() }

// CMemory says, as log attributes in KiB, where tcmalloc's memory (the
// C heap: librbd, librados) is: allocated, held in its caches, free in
// its page heap, and handed back.
func CMemory() []any {
	props := []struct{ key, name string }{
		{"allocated", "generic.current_allocated_bytes"},
		{"heap", "generic.heap_size"},
		{"pageheap_free", "tcmalloc.pageheap_free_bytes"},
		{"released", "tcmalloc.pageheap_unmapped_bytes"},
		{"central_cache", "tcmalloc.central_cache_free_bytes"},
		{"transfer_cache", "tcmalloc.transfer_cache_free_bytes"},
		{"thread_caches", "tcmalloc.thread_cache_free_bytes"},
	}
	attrs := make([]any, 0, 2*len(props))
	for _, p := range props {
		name := C.CString(p.name)
		var v C.size_t
		ok := C.MallocExtension_GetNumericProperty(name, &v) != 0
		C.free(unsafe.Pointer(name))
		if ok {
			attrs = append(attrs, "c_"+p.key+"_kib", uint64(v)>>10)
		}
	}
	return attrs
}
