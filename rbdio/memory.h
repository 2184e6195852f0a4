// librbd's allocator, jemalloc (memory.c, memory.go).
#ifndef NBDGO_MEMORY_H
#define NBDGO_MEMORY_H

#include <stddef.h>
#include <stdint.h>

void nbdgo_purge(void);
void nbdgo_refresh(void); // the statistics, once before reading them
int nbdgo_stat(const char *name, size_t *v);
int nbdgo_opt_ssize(const char *name, int64_t *v);

#endif
