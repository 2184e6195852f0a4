package rbdio

// librbd features beyond the data path: client-side LUKS encryption and
// the quiesce watch used around snapshots. Same rule as aio.go: C
// callbacks only write to a file descriptor; Go reads it.

/*
#cgo LDFLAGS: -lrbd
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <rbd/librbd.h>

static void nbdgo_quiesce_cb(void *arg) {
	char c = 'q';
	ssize_t r = write((int)(intptr_t)arg, &c, 1);
	(void)r;
}

static void nbdgo_unquiesce_cb(void *arg) {
	char c = 'u';
	ssize_t r = write((int)(intptr_t)arg, &c, 1);
	(void)r;
}

static int nbdgo_quiesce_watch(rbd_image_t img, uint64_t *h, int fd) {
	return rbd_quiesce_watch(img, nbdgo_quiesce_cb, nbdgo_unquiesce_cb, (void *)(intptr_t)fd, h);
}

// The passphrase is wiped from C memory as soon as librbd has it.
static int nbdgo_encryption_load(rbd_image_t img, int luks2, char *pass, size_t len) {
	int r;
	if (luks2) {
		rbd_encryption_luks2_format_options_t o;
		memset(&o, 0, sizeof o);
		o.passphrase = pass;
		o.passphrase_size = len;
		r = rbd_encryption_load(img, RBD_ENCRYPTION_FORMAT_LUKS2, &o, sizeof o);
	} else {
		rbd_encryption_luks1_format_options_t o;
		memset(&o, 0, sizeof o);
		o.passphrase = pass;
		o.passphrase_size = len;
		r = rbd_encryption_load(img, RBD_ENCRYPTION_FORMAT_LUKS1, &o, sizeof o);
	}
	return r;
}

// explicit_bzero: a memset right before free may be optimised away.
static void nbdgo_wipe_free(char *p, size_t len) {
	explicit_bzero(p, len);
	free(p);
}
*/
import "C"

import (
	"fmt"
	"log/slog"
)

// Encryption opens a LUKS-formatted image through librbd's client-side
// encryption (the image must have been formatted with
// `rbd encryption format`). Format is luks1, luks2, or luks (either).
type Encryption struct {
	Format     string `json:"format,omitempty"`
	Passphrase string `json:"passphrase,omitempty"`
}

// LogValue keeps the passphrase out of logs.
func (e Encryption) LogValue() slog.Value { return slog.StringValue(e.Format) }

// Validate checks the format name.
func (e Encryption) Validate() error {
	switch e.Format {
	case "", "luks", "luks1", "luks2":
	default:
		return fmt.Errorf("unknown encryption format %q (want luks, luks1 or luks2)", e.Format)
	}
	if e.Format != "" && e.Passphrase == "" {
		return fmt.Errorf("encryption format %s needs a passphrase file", e.Format)
	}
	return nil
}

// rbd_encryption_load.
func (i cImage) loadEncryption(e Encryption) error {
	try := []bool{e.Format == "luks2"}
	if e.Format == "luks" {
		try = []bool{true, false}
	}
	var err error
	for _, luks2 := range try {
		n := C.size_t(len(e.Passphrase))
		p := C.CString(e.Passphrase) // no extra Go copy to leave behind
		r := C.nbdgo_encryption_load(i.p, boolInt(luks2), p, n)
		C.nbdgo_wipe_free(p, n)
		if err = errnoOf(r); err == nil {
			return nil
		}
	}
	return err
}

func boolInt(b bool) C.int {
	if b {
		return 1
	}
	return 0
}

// rbd_quiesce_watch: fd gets 'q' on quiesce and 'u' on unquiesce.
func (i cImage) quiesceWatch(fd int) (uint64, error) {
	var h C.uint64_t
	err := errnoOf(C.nbdgo_quiesce_watch(i.p, &h, C.int(fd)))
	return uint64(h), err
}

func (i cImage) quiesceComplete(h uint64, r int) {
	C.rbd_quiesce_complete(i.p, C.uint64_t(h), C.int(r))
}

func (i cImage) quiesceUnwatch(h uint64) error {
	return errnoOf(C.rbd_quiesce_unwatch(i.p, C.uint64_t(h)))
}
