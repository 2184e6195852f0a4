package rbdio

// librbd's client-side LUKS encryption (rbd_encryption_load).

/*
#cgo LDFLAGS: -lrbd
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <rbd/librbd.h>

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
	"github.com/ceph/go-ceph/rbd"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
)

// rbd_encryption_load.
func (i cImage) loadEncryption(e ceph.Encryption) error {
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

// FormatEncryption writes a LUKS2 header (aes-256-xts) with passphrase
// at the start of spec's image, which must hold no data yet: librbd's
// format overwrites its first 16 MiB. Reads and writes through an image
// opened with the passphrase then see the rest, encrypted on the OSDs.
func (c *Clusters) FormatEncryption(o ceph.Options, spec ceph.ImageSpec, passphrase []byte) error {
	img, release, err := c.image(o, spec, false)
	if err != nil {
		return err
	}
	defer release()
	if err := img.EncryptionFormat(rbd.EncryptionOptionsLUKS2{
		Alg: rbd.EncryptionAlgorithmAES256, Passphrase: passphrase}); err != nil {
		return imageError(spec, "format LUKS2 on", err)
	}
	return nil
}
