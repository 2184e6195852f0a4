package attach

import (
	"fmt"

	"github.com/rbd-nbd-go/rbd-nbd-go/control"
)

// Keys holds the passphrases of encrypted devices for as long as they are
// mapped, outside the state directory (which must never hold one) and
// beyond this process: a restarted daemon reads them back to reopen the
// images. The node daemon uses the kernel's user keyring
// (keyring.Kernel); tests use a map.
type Keys interface {
	Put(name string, secret []byte) error
	Get(name string) ([]byte, error)
	Remove(name string) error
}

// keyName names a device's passphrase: its index and cookie, so a key
// left by a device long gone never opens a new one at the same index.
func keyName(rec control.Record) string { return fmt.Sprintf("nbd%d:%s", rec.Index, rec.Cookie) }

// withPassphrase fills in the passphrase of an encrypted record that has
// none (one read back from the state directory) from the keys.
func (m *Manager) withPassphrase(rec control.Record) (control.Record, error) {
	if rec.Encryption.Format == "" || rec.Encryption.Passphrase != "" {
		return rec, nil
	}
	b, err := m.cfg.Keys.Get(keyName(rec))
	if err != nil {
		return rec, fmt.Errorf("%s is encrypted and its passphrase is gone: %w", rec.Device(), err)
	}
	rec.Encryption.Passphrase = string(b)
	clear(b)
	return rec, nil
}

// keepPassphrase moves rec's passphrase into the keys and returns rec
// without it: what the manager keeps and the store saves.
func (m *Manager) keepPassphrase(rec control.Record) (control.Record, error) {
	if rec.Encryption.Passphrase == "" {
		return rec, nil
	}
	if err := m.cfg.Keys.Put(keyName(rec), []byte(rec.Encryption.Passphrase)); err != nil {
		return rec, fmt.Errorf("keep the passphrase of %s: %w", rec.Device(), err)
	}
	rec.Encryption.Passphrase = ""
	return rec, nil
}

// dropPassphrase forgets an unmapped device's passphrase.
func (m *Manager) dropPassphrase(rec control.Record) error {
	if rec.Encryption.Format == "" {
		return nil
	}
	if err := m.cfg.Keys.Remove(keyName(rec)); err != nil {
		return fmt.Errorf("forget the passphrase of %s: %w", rec.Device(), err)
	}
	return nil
}
