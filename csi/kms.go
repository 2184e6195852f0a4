package csi

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"os"

	"golang.org/x/crypto/scrypt"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Key management, ceph-csi's interface: a StorageClass's encryptionKMSID
// names an entry of the KMS config (the csi-kms-connection-details
// ConfigMap, mounted as a JSON file), whose encryptionKMSType says how a
// volume's LUKS passphrase is kept. No ID means the "default" kind. The
// formats are ceph-csi's, so the volumes it made open here.

// DefaultKMSConfig is where ceph-csi's deployments mount the KMS config.
const DefaultKMSConfig = "/etc/ceph-csi-encryption-kms-config/config.json"

// secretPassphraseKey is the Secret's key both kinds read.
const secretPassphraseKey = "encryptionPassphrase"

// keyManager gives volumes their LUKS passphrases. volID salts what it
// stores, so a volume's stored key opens no other volume.
type keyManager interface {
	// newKey is the passphrase for a new volume and the image metadata
	// to keep with it.
	newKey(volID string) (pass []byte, meta map[string]string, err error)
	// key gives an existing volume's passphrase back from its image's
	// metadata.
	key(volID string, meta map[string]string) ([]byte, error)
	// wrap is the metadata that keeps pass for volID: a clone's copy of
	// its parent's key.
	wrap(volID string, pass []byte) (map[string]string, error)
}

// errBadKey: the Secret's passphrase does not unwrap a volume's stored key
// (or the stored key was damaged). Like a LUKS passphrase that opens no
// keyslot, it is PermissionDenied.
var errBadKey = errors.New("the Secret's encryptionPassphrase does not unwrap the volume's key (wrong passphrase, or damaged metadata)")

// keyManagerFor resolves a KMS ID with the request's secrets: unknown IDs
// and kinds, and missing Secret keys, are InvalidArgument.
func keyManagerFor(configPath, kmsID string, secrets map[string]string) (keyManager, error) {
	kind := "default"
	if kmsID != "" {
		entry, err := kmsEntry(configPath, kmsID)
		if err != nil {
			return nil, err
		}
		var e struct {
			Type       string `json:"encryptionKMSType"`
			SecretName string `json:"secretName"`
		}
		if err := json.Unmarshal(entry, &e); err != nil {
			return nil, status.Errorf(codes.InvalidArgument, "KMS config %s, entry %q: %v", configPath, kmsID, err)
		}
		if e.SecretName != "" {
			return nil, status.Errorf(codes.InvalidArgument,
				"KMS %q: secretName is not supported here; put %s in the StorageClass's Secret", kmsID, secretPassphraseKey)
		}
		kind = e.Type
	}
	switch kind {
	case "default", "metadata":
		pass := secrets[secretPassphraseKey]
		if pass == "" {
			return nil, status.Errorf(codes.InvalidArgument, "encryption (KMS %q, kind %s) needs %s in the Secret",
				kmsID, kind, secretPassphraseKey)
		}
		if kind == "default" {
			return secretKMS(pass), nil
		}
		return metadataKMS(pass), nil
	case "":
		return nil, status.Errorf(codes.InvalidArgument, "KMS %q has no encryptionKMSType", kmsID)
	}
	return nil, status.Errorf(codes.InvalidArgument,
		"KMS %q is of kind %q, which this driver does not support (default and metadata are)", kmsID, kind)
}

// kmsEntry reads one entry of the KMS config. The file is read at each
// use, so an updated ConfigMap takes effect without a restart.
func kmsEntry(path, id string) (json.RawMessage, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, status.Errorf(codes.InvalidArgument, "encryptionKMSID %q: no KMS config at %s", id, path)
	}
	if err != nil {
		return nil, status.Errorf(codes.Internal, "KMS config: %v", err)
	}
	var all map[string]json.RawMessage
	if err := json.Unmarshal(b, &all); err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "KMS config %s: %v", path, err)
	}
	e, ok := all[id]
	if !ok {
		return nil, status.Errorf(codes.InvalidArgument, "encryptionKMSID %q is not in the KMS config %s", id, path)
	}
	return e, nil
}

// secretKMS is ceph-csi's "default" kind: the Secret's passphrase is
// every volume's LUKS passphrase, and nothing is stored.
type secretKMS string

func (k secretKMS) newKey(string) ([]byte, map[string]string, error) { return []byte(k), nil, nil }
func (k secretKMS) key(string, map[string]string) ([]byte, error)    { return []byte(k), nil }

// wrap: a clone under the default kind opens with the Secret's
// passphrase, which must therefore be its parent's.
func (k secretKMS) wrap(_ string, pass []byte) (map[string]string, error) {
	if string(pass) != string(k) {
		return nil, status.Error(codes.InvalidArgument,
			"the source's key is not this Secret's encryptionPassphrase, and the default KMS stores no other")
	}
	return nil, nil
}

// metadataKMS is ceph-csi's "metadata" kind: each volume has a random
// passphrase (20 bytes, base64url, as ceph-csi makes them), kept in its
// image's metadata sealed with AES-256-GCM under a key derived from the
// Secret's passphrase by scrypt, salted with the volume ID.
type metadataKMS string

// sealedKey is the stored form, ceph-csi's JSON (byte slices as base64).
type sealedKey struct {
	DEK   []byte `json:"dek"`
	Nonce []byte `json:"nonce"`
}

func (k metadataKMS) aead(volID string) (cipher.AEAD, error) {
	key, err := scrypt.Key([]byte(k), []byte(volID), 32768, 8, 1, 32)
	if err != nil {
		return nil, err
	}
	b, err := aes.NewCipher(key)
	if err != nil {
		return nil, err
	}
	return cipher.NewGCM(b)
}

func (k metadataKMS) newKey(volID string) ([]byte, map[string]string, error) {
	raw := make([]byte, 20)
	if _, err := rand.Read(raw); err != nil {
		return nil, nil, err
	}
	pass := []byte(base64.URLEncoding.EncodeToString(raw))
	clear(raw)
	meta, err := k.wrap(volID, pass)
	return pass, meta, err
}

func (k metadataKMS) wrap(volID string, pass []byte) (map[string]string, error) {
	a, err := k.aead(volID)
	if err != nil {
		return nil, err
	}
	s := sealedKey{Nonce: make([]byte, a.NonceSize())}
	if _, err := rand.Read(s.Nonce); err != nil {
		return nil, err
	}
	s.DEK = a.Seal(nil, s.Nonce, pass, nil)
	b, err := json.Marshal(s)
	if err != nil {
		return nil, err
	}
	return map[string]string{metaDEK: string(b)}, nil
}

func (k metadataKMS) key(volID string, meta map[string]string) ([]byte, error) {
	stored, ok := meta[metaDEK]
	if !ok {
		return nil, fmt.Errorf("the image has no %s metadata: its key is not kept by a metadata KMS", metaDEK)
	}
	var s sealedKey
	if err := json.Unmarshal([]byte(stored), &s); err != nil {
		return nil, fmt.Errorf("%w: %s is not a sealed key", errBadKey, metaDEK)
	}
	a, err := k.aead(volID)
	if err != nil {
		return nil, err
	}
	if len(s.Nonce) != a.NonceSize() {
		return nil, fmt.Errorf("%w: %s has a %d-byte nonce", errBadKey, metaDEK, len(s.Nonce))
	}
	pass, err := a.Open(nil, s.Nonce, s.DEK, nil)
	if err != nil {
		return nil, errBadKey
	}
	return pass, nil
}
