// The C++ half of rbdio's cgo layer. librbd's C API reads only into
// caller memory, which costs a copy of every byte out of the buffers the
// messenger received (at 1 MiB reads, a fifth of the server's CPU). Its
// C++ API can instead hand back a bufferlist that references those
// buffers; its segments are lent to the NBD server and the bufferlist is
// freed when the server is done with them.

#include <cerrno>
#include <cstring>
#include <new>

#include <rbd/librbd.hpp>

#include "lend.h"

struct nbdgo_bl {
	ceph::bufferlist bl;
};

// librbd::Image is a handle whose one member is the ImageCtx pointer that
// the C API calls rbd_image_t (librbd.cc casts between the two). There is
// no public way to build an Image around an image opened through the C
// API, so the view writes that member directly; Go checks the view by
// comparing its size() with rbd_get_size before using it, and the view
// is cleared again before it is destroyed, so it never closes the image.
static_assert(sizeof(librbd::Image) == sizeof(rbd_image_t),
              "librbd::Image is expected to hold just the image pointer");

extern "C" void *nbdgo_cxx_image(rbd_image_t img) {
	auto *view = new (std::nothrow) librbd::Image();
	if (view == nullptr)
		return nullptr;
	std::memcpy(static_cast<void *>(view), &img, sizeof img);
	uint64_t a = 0, b = 1;
	if (view->size(&a) < 0 || rbd_get_size(img, &b) < 0 || a != b) {
		nbdgo_cxx_image_free(view);
		return nullptr;
	}
	return view;
}

extern "C" void nbdgo_cxx_image_free(void *view) {
	rbd_image_t none = nullptr;
	std::memcpy(view, &none, sizeof none);
	delete static_cast<librbd::Image *>(view);
}

extern "C" struct nbdgo_bl *nbdgo_bl_new(void) { return new (std::nothrow) nbdgo_bl; }

// nbdgo_aio_read_bl starts a read whose data librbd leaves in b. c is a
// completion made with rbd_aio_create_completion: the C API's
// rbd_completion_t is a librbd::RBD::AioCompletion.
extern "C" int nbdgo_aio_read_bl(void *view, uint64_t off, uint64_t len, rbd_completion_t c,
                                 struct nbdgo_bl *b) {
	try {
		return static_cast<librbd::Image *>(view)->aio_read2(
			off, len, b->bl, static_cast<librbd::RBD::AioCompletion *>(c), 0);
	} catch (const std::bad_alloc &) {
		return -ENOMEM;
	}
}

// nbdgo_bl_segments lists the bufferlist's segments: how many, or -ERANGE
// when there are more than max (the caller then copies instead).
extern "C" int nbdgo_bl_segments(struct nbdgo_bl *b, struct iovec *iov, int max, uint64_t *total) {
	*total = b->bl.length();
	if (b->bl.get_num_buffers() > static_cast<unsigned>(max))
		return -ERANGE;
	int n = 0;
	for (const auto &p : b->bl.buffers()) {
		if (p.length() == 0)
			continue;
		iov[n].iov_base = const_cast<char *>(p.c_str());
		iov[n].iov_len = p.length();
		n++;
	}
	return n;
}

extern "C" void nbdgo_bl_free(struct nbdgo_bl *b) { delete b; }

// nbdgo_bl_copy copies the bufferlist into buf, zero-filling what it does
// not cover: a bufferlist read may stop short where the image has holes.
extern "C" void nbdgo_bl_copy(struct nbdgo_bl *b, char *buf, uint64_t len) {
	uint64_t n = b->bl.length() < len ? b->bl.length() : len;
	b->bl.begin().copy(n, buf);
	std::memset(buf + n, 0, len - n);
}
