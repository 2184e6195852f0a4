package ceph

import (
	"errors"
	"fmt"
	"log/slog"
)

// ErrBadPassphrase: the passphrase opens no keyslot of the image's LUKS
// header.
var ErrBadPassphrase = errors.New("the passphrase does not open the image's LUKS header")

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
