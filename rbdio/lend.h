// C view of the C++ half of rbdio's cgo layer (lend.cc): reads into
// bufferlists that librbd fills by reference, so their bytes can be lent
// to the NBD server instead of copied.
#ifndef RBDIO_LEND_H
#define RBDIO_LEND_H

#include <stdint.h>
#include <sys/uio.h>
#include <rbd/librbd.h>

#ifdef __cplusplus
extern "C" {
#endif

struct nbdgo_bl;

void *nbdgo_cxx_image(rbd_image_t img);
void nbdgo_cxx_image_free(void *view);
struct nbdgo_bl *nbdgo_bl_new(void);
int nbdgo_aio_read_bl(void *view, uint64_t off, uint64_t len, rbd_completion_t c, struct nbdgo_bl *b);
int nbdgo_bl_segments(struct nbdgo_bl *b, struct iovec *iov, int max, uint64_t *total);
void nbdgo_bl_copy(struct nbdgo_bl *b, char *buf, uint64_t len);
void nbdgo_bl_free(struct nbdgo_bl *b);

#ifdef __cplusplus
}
#endif
#endif
