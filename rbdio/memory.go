package rbdio

// librbd's allocator. The binary links jemalloc ahead of libc, so
// librbd's and librados' many small allocations per I/O (bufferlists,
// completions, messenger frames) go to it rather than to glibc's
// malloc, whose malloc/free was about 13 % of the serving process's CPU
// at 4k QD32.
//
// It was tcmalloc until issue 14. tcmalloc kept what the threads of a
// closed cluster connection had cached in its transfer caches for good
// (gperftools 2.10 has no call that drains them): 4-5 MiB above the
// daemon's start-up size after 32 devices came and went. jemalloc hands
// freed objects back to their slabs, and a purge returns every page no
// live object is on. In one VM run (bench/reference/vm-scale), 60 s
// after the last of 32 devices went: tcmalloc +9.3 % and +11.0 % of
// start-up (2 and 16 connections), jemalloc -0.4 % and +0.2 %, at the
// same Pss under load; on the host, 4k QD32 through librbd, the serving
// process's CPU per I/O was 3 % (reads) and 6 % (writes) lower
// (bench/reference/rbd/2026-11-25-jemalloc).

/*
#cgo LDFLAGS: -l:libjemalloc.so.2
#include <stdlib.h>
#include "memory.h"
*/
import "C"

import "unsafe"

// ReleaseFreeMemory hands jemalloc's free pages (librbd's and librados'
// heap) back to the system: every arena's dirty pages, purged.
func ReleaseFreeMemory() { C.nbdgo_purge() }

// CMemory says, as log attributes in KiB, where jemalloc's memory (the C
// heap: librbd, librados) is: allocated, in active pages, resident
// (its metadata included), its own metadata, and mapped.
func CMemory() []any {
	props := []struct{ key, name string }{
		{"allocated", "stats.allocated"},
		{"active", "stats.active"},
		{"resident", "stats.resident"},
		{"metadata", "stats.metadata"},
		{"mapped", "stats.mapped"},
	}
	attrs := make([]any, 0, 2*len(props))
	C.nbdgo_refresh()
	for _, p := range props {
		name := C.CString(p.name)
		var v C.size_t
		ok := C.nbdgo_stat(name, &v) != 0
		C.free(unsafe.Pointer(name))
		if ok {
			attrs = append(attrs, "c_"+p.key+"_kib", uint64(v)>>10)
		}
	}
	return attrs
}

// decayMS is jemalloc's opt.dirty_decay_ms: -1 (never) if memory.c's
// setting took.
func decayMS() (int64, bool) {
	name := C.CString("opt.dirty_decay_ms")
	defer C.free(unsafe.Pointer(name))
	var v C.int64_t
	ok := C.nbdgo_opt_ssize(name, &v) != 0
	return int64(v), ok
}

// cAllocate returns n bytes from C's malloc and a func that frees them:
// for the test that C's malloc is jemalloc's.
func cAllocate(n int) (free func()) {
	p := C.malloc(C.size_t(n))
	return func() { C.free(p) }
}
