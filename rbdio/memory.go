package rbdio

/*
#cgo LDFLAGS: -l:libtcmalloc_minimal.so.4
void MallocExtension_ReleaseFreeMemory(void);
*/
import "C"

// ReleaseFreeMemory hands tcmalloc's free pages back to the system:
// librbd's and librados' heap, which stays at its peak after images
// close until something asks (MallocExtension::ReleaseFreeMemory).
func ReleaseFreeMemory() { C.MallocExtension_ReleaseFreeMemory() }
