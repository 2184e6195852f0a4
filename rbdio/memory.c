// librbd's allocator, jemalloc: its settings, its purge, its statistics
// (see memory.go). Linked by soname (-l:libjemalloc.so.2), so only the
// runtime package is needed; mallctl is declared here rather than taken
// from jemalloc's header, which is in the -dev package.

#include <sys/types.h>
#include "memory.h"

int mallctl(const char *name, void *oldp, size_t *oldlenp, void *newp, size_t newlen);

// jemalloc reads this at its start-up; MALLOC_CONF still overrides it.
// No decay: the daemon's pages are locked (mlockall), so the purges that
// decay would make as the I/O path allocates could only fail; the daemon
// purges itself once devices went away, unlocked (ReleaseFreeMemory).
const char *malloc_conf = "dirty_decay_ms:-1,muzzy_decay_ms:-1";

void nbdgo_purge(void) {
	// MALLCTL_ARENAS_ALL (4096): every arena.
	mallctl("arena.4096.purge", NULL, NULL, NULL, 0);
}

void nbdgo_refresh(void) {
	uint64_t epoch = 1;
	size_t sz = sizeof epoch;
	mallctl("epoch", &epoch, &sz, &epoch, sz);
}

int nbdgo_stat(const char *name, size_t *v) {
	size_t sz = sizeof *v;
	return mallctl(name, v, &sz, NULL, 0) == 0;
}

int nbdgo_opt_ssize(const char *name, int64_t *v) {
	ssize_t x;
	size_t sz = sizeof x;
	if (mallctl(name, &x, &sz, NULL, 0) != 0)
		return 0;
	*v = x;
	return 1;
}
