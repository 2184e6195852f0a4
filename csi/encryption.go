package csi

import (
	"errors"
	"fmt"
	"maps"
	"strconv"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
	"github.com/rbd-nbd-go/rbd-nbd-go/control"
)

// Encrypted volumes are LUKS2 images formatted and opened by librbd
// itself: the controller formats a new volume (so it needs the Secret's
// encryptionPassphrase, as ceph-csi's controller does for its metadata
// KMS), and the node daemon loads the key when it maps it. No dm-crypt
// device, no cryptsetup; ciphertext is all that reaches the OSDs.
//
// The image metadata keys are ceph-csi's, so a volume it encrypted with
// cryptsetup (LUKS2 on the mapped device) opens here too.
const (
	metaEncrypted = "rbd.csi.ceph.com/encrypted" // stateEncrypted or statePrepared
	metaDEK       = "rbd.csi.ceph.com/dek"       // a metadata KMS's sealed key
	// metaKMSID names the KMS config entry that keeps the key.
	metaKMSID = "rbd-nbd-go.csi.io/encryption-kms-id"
	// metaDEKSalt is the volume ID a metadata KMS sealed the key under:
	// a volume's ID changes when it is deleted and kept for its
	// snapshots (csi-gone-*), and its restores still need the key.
	metaDEKSalt = "rbd-nbd-go.csi.io/dek-salt"
	// metaKeyOf says a volume opens with another volume's key: a clone
	// or restore of an encrypted volume, as librbd 16.2 has no key of a
	// clone's own.
	metaKeyOf = "rbd-nbd-go.csi.io/encryption-key-of"

	stateEncrypted = "encrypted"
	statePrepared  = "encryptionPrepared" // key made, header not yet written

	// luksHeaderBytes is the LUKS2 header at the start of the image,
	// librbd's and cryptsetup's default alike: an encrypted volume's
	// image is that much larger than the volume it offers.
	luksHeaderBytes = 16 << 20

	// ctxCephCSIVolumeID, in a static volume's attributes, is the
	// volume handle ceph-csi gave it: its metadata KMS sealed the key
	// under that ID.
	ctxCephCSIVolumeID = "cephcsiVolumeID"
)

// encryption is a StorageClass's (or volume context's) encryption
// settings, ceph-csi's parameter names.
type encryption struct {
	On    bool
	KMSID string
}

func parseEncryption(in map[string]string) (encryption, error) {
	var e encryption
	if v, ok := in["encrypted"]; ok {
		b, err := strconv.ParseBool(v)
		if err != nil {
			return e, fmt.Errorf("parameter %q: %q is not true or false", "encrypted", v)
		}
		e.On = b
	}
	switch t := in["encryptionType"]; t {
	case "", "block":
	case "file":
		return e, errors.New(`parameter "encryptionType": "file" (fscrypt) is not supported; use "block"`)
	default:
		return e, fmt.Errorf("parameter %q: unknown type %q (want block)", "encryptionType", t)
	}
	e.KMSID = in["encryptionKMSID"]
	return e, nil
}

// context adds what NodeStage needs to c.
func (e encryption) context(c map[string]string) {
	if !e.On {
		return
	}
	c["encrypted"] = "true"
	if e.KMSID != "" {
		c["encryptionKMSID"] = e.KMSID
	}
}

func isEncrypted(meta map[string]string) bool { return meta[metaEncrypted] != "" }

// usableBytes is what a volume offers: its image's size, less the LUKS
// header if it is encrypted.
func usableBytes(size uint64, meta map[string]string) uint64 {
	if isEncrypted(meta) && size >= luksHeaderBytes {
		return size - luksHeaderBytes
	}
	return size
}

// imageBytes is the image size for a volume of size bytes.
func imageBytes(size uint64, encrypted bool) uint64 {
	if encrypted {
		return size + luksHeaderBytes
	}
	return size
}

// dekSalt is the ID a volume's key is sealed under.
func dekSalt(volID string, meta, volCtx map[string]string) string {
	if s := meta[metaDEKSalt]; s != "" {
		return s
	}
	if s := volCtx[ctxCephCSIVolumeID]; s != "" {
		return s
	}
	return volID
}

// newEncryptionMeta makes a new volume's key: the metadata its image is
// created with (state prepared) and the passphrase to format it with.
func (d *Driver) newEncryptionMeta(e encryption, volID string, secrets map[string]string) ([]byte, map[string]string, error) {
	km, err := keyManagerFor(d.cfg.KMSConfig, e.KMSID, secrets)
	if err != nil {
		return nil, nil, err
	}
	pass, meta, err := km.newKey(volID)
	if err != nil {
		return nil, nil, status.Errorf(codes.Internal, "make a key: %v", err)
	}
	if meta == nil {
		meta = map[string]string{}
	}
	meta[metaEncrypted] = statePrepared
	meta[metaKMSID] = e.KMSID
	if meta[metaDEK] != "" {
		meta[metaDEKSalt] = volID
	}
	return pass, meta, nil
}

// volumeKey is an encrypted volume's passphrase, from its image's
// metadata and the KMS its ID names: InvalidArgument for a bad KMS or
// Secret, PermissionDenied for a Secret that does not unwrap it.
func (d *Driver) volumeKey(kmsID, volID string, meta, volCtx, secrets map[string]string) ([]byte, error) {
	km, err := keyManagerFor(d.cfg.KMSConfig, kmsID, secrets)
	if err != nil {
		return nil, err
	}
	pass, err := km.key(dekSalt(volID, meta, volCtx), meta)
	switch {
	case errors.Is(err, errBadKey):
		return nil, status.Error(codes.PermissionDenied, err.Error())
	case err != nil:
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	return pass, nil
}

// formatPrepared writes the LUKS2 header of a volume whose key is made
// but whose header is not (a new volume, or one whose creator died
// between the two), then marks it encrypted. The volume holds no data
// yet, so a format repeated after a crash loses nothing.
func (d *Driver) formatPrepared(o ceph.Options, vol volume, pass []byte) error {
	if err := d.cfg.Images.FormatEncryption(o, vol.Spec, pass); err != nil {
		return cephStatus(err, "format LUKS2 on "+describe(vol))
	}
	if err := d.cfg.Images.UpdateMetadata(o, vol.Spec, map[string]string{metaEncrypted: stateEncrypted}, nil); err != nil {
		return cephStatus(err, "mark "+describe(vol)+" encrypted")
	}
	return nil
}

// cloneEncryption is the metadata a clone or restore of src gets: an
// encrypted source's key, sealed again for the new volume (it opens with
// its parent's key: librbd 16.2 cannot give a clone its own). An
// encrypted source needs an encrypted StorageClass and the other way
// round: a clone's data is its parent's, encrypted or not.
func (d *Driver) cloneEncryption(src *volSource, e encryption, volID string, secrets map[string]string) (map[string]string, error) {
	switch {
	case !isEncrypted(src.meta) && !e.On:
		return nil, nil
	case !e.On:
		return nil, status.Errorf(codes.InvalidArgument,
			"the source %s is encrypted: the StorageClass must set encrypted: \"true\"", src.id())
	case !isEncrypted(src.meta):
		return nil, status.Errorf(codes.InvalidArgument,
			"the source %s is not encrypted, and a clone cannot be encrypted apart from its parent", src.id())
	case src.meta[metaEncrypted] != stateEncrypted:
		return nil, status.Errorf(codes.FailedPrecondition, "the source %s has no LUKS header yet", src.id())
	}
	pass, err := d.volumeKey(src.meta[metaKMSID], src.volID, src.meta, nil, secrets)
	if err != nil {
		return nil, err
	}
	defer clear(pass)
	km, err := keyManagerFor(d.cfg.KMSConfig, e.KMSID, secrets)
	if err != nil {
		return nil, err
	}
	meta, err := km.wrap(volID, pass)
	if err != nil {
		return nil, err
	}
	out := map[string]string{metaEncrypted: stateEncrypted, metaKMSID: e.KMSID, metaKeyOf: src.ref.String()}
	maps.Copy(out, meta)
	if meta[metaDEK] != "" {
		out[metaDEKSalt] = volID
	}
	return out, nil
}

// stageKey gives the node daemon an encrypted volume's passphrase for the
// map (into dev), formatting first a volume whose header was never
// written (one ceph-csi prepared but never staged). Only the map carries
// the passphrase: the daemon keeps it in the kernel keyring, never in a
// record. A volume context without encryption stages as before.
func (d *Driver) stageKey(o ceph.Options, vol volume, volCtx, secrets map[string]string, dev *control.Record) error {
	enc, err := parseEncryption(volCtx)
	if err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	if !enc.On {
		return nil
	}
	if d.cfg.Images == nil {
		return status.Error(codes.FailedPrecondition, "this node plugin has no image access to open encrypted volumes")
	}
	info, err := d.cfg.Images.ImageInfo(o, vol.Spec)
	if err != nil {
		return cephStatus(err, "look up "+describe(vol))
	}
	if !isEncrypted(info.Meta) {
		return status.Errorf(codes.FailedPrecondition,
			"volume %s is set encrypted, but its image has no %s metadata", describe(vol), metaEncrypted)
	}
	pass, err := d.volumeKey(enc.KMSID, vol.ID(), info.Meta, volCtx, secrets)
	if err != nil {
		return err
	}
	defer clear(pass)
	if info.Meta[metaEncrypted] == statePrepared {
		if err := d.formatPrepared(o, vol, pass); err != nil {
			return err
		}
	}
	if cephID := volCtx[ctxCephCSIVolumeID]; cephID != "" && info.Meta[metaDEK] != "" && info.Meta[metaDEKSalt] == "" {
		// A volume ceph-csi made, whose sealed key just opened under the
		// ID it was given: keep that ID, for the restores of its
		// snapshots (no volume context reaches CreateVolume).
		if err := d.cfg.Images.UpdateMetadata(o, vol.Spec, map[string]string{metaDEKSalt: cephID}, nil); err != nil {
			d.log.Warn("record the salt of a migrated volume's key", "volume", vol.ID(), "err", err)
		}
	}
	if _, ours := info.Meta[metaKMSID]; !ours && dev.BlockSize == 0 {
		// ceph-csi formatted it through a 512-byte-sector device
		// (rbd-nbd's and krbd's), and so did mkfs: an ext4 under
		// 512 MiB has 1 KiB blocks, an xfs 512-byte sectors, and
		// neither mounts on a 4 KiB-sector device.
		dev.BlockSize = 512
	}
	// "luks": LUKS2 as we and ceph-csi format, LUKS1 as older tools did.
	dev.Encryption = ceph.Encryption{Format: "luks", Passphrase: string(pass)}
	return nil
}
