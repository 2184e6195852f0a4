// Package keyring keeps small secrets in the kernel's user keyring (uid 0),
// where they outlive the process that put them there but not the node:
// a restarted node daemon reads an encrypted device's passphrase back from
// here instead of from its state directory, which must never hold one.
// Key payloads live in unswappable kernel memory, readable only by root.
package keyring

import (
	"errors"
	"fmt"
	"runtime"

	"golang.org/x/sys/unix"
)

// Kernel keeps secrets in the calling user's user keyring, each named
// Prefix+name.
type Kernel struct{ Prefix string }

// ErrNotFound: no such key (never stored, or removed).
var ErrNotFound = errors.New("no such key in the kernel keyring")

// Permissions: the possessor may do anything; the owning user (root) may
// view, read and search, so a later process of the same user finds the
// key even if it does not possess the keyring.
const perm = 0x3f000000 | 0x00010000 | 0x00020000 | 0x00080000

func (k Kernel) desc(name string) string { return k.Prefix + name }

// possess links the user keyring into the calling thread's session
// keyring, as pam_keyinit does at login, so the keys in it are ours to
// change and remove. A container starts with a new, empty session keyring
// that is not linked to it: there, a key added to the user keyring is
// not possessed by its adder, who may only view it. Linking twice is no
// error; a failure leaves the permissions to say what is allowed.
func possess() {
	unix.KeyctlInt(unix.KEYCTL_LINK, unix.KEY_SPEC_USER_KEYRING, unix.KEY_SPEC_SESSION_KEYRING, 0, 0)
}

// Put stores (or replaces) secret under name.
func (k Kernel) Put(name string, secret []byte) error {
	runtime.LockOSThread() // the session keyring is the thread's
	defer runtime.UnlockOSThread()
	possess()
	id, err := unix.AddKey("user", k.desc(name), secret, unix.KEY_SPEC_USER_KEYRING)
	if err != nil {
		return fmt.Errorf("kernel keyring: add key: %w", err)
	}
	if _, err := unix.KeyctlInt(unix.KEYCTL_SETPERM, id, perm, 0, 0); err != nil {
		unix.KeyctlInt(unix.KEYCTL_INVALIDATE, id, 0, 0, 0)
		return fmt.Errorf("kernel keyring: set key permissions: %w", err)
	}
	return nil
}

func (k Kernel) find(name string) (int, error) {
	possess()
	id, err := unix.KeyctlSearch(unix.KEY_SPEC_USER_KEYRING, "user", k.desc(name), 0)
	if errors.Is(err, unix.ENOKEY) || errors.Is(err, unix.EKEYREVOKED) || errors.Is(err, unix.EKEYEXPIRED) {
		return 0, ErrNotFound
	}
	if err != nil {
		return 0, fmt.Errorf("kernel keyring: search: %w", err)
	}
	return id, nil
}

// Get reads the secret stored under name.
func (k Kernel) Get(name string) ([]byte, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	id, err := k.find(name)
	if err != nil {
		return nil, err
	}
	buf := make([]byte, 512)
	for {
		n, err := unix.KeyctlBuffer(unix.KEYCTL_READ, id, buf, 0)
		if err != nil {
			return nil, fmt.Errorf("kernel keyring: read: %w", err)
		}
		if n <= len(buf) {
			return buf[:n], nil
		}
		clear(buf)
		buf = make([]byte, n)
	}
}

// Remove invalidates the key stored under name; a missing key is no
// error.
func (k Kernel) Remove(name string) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	id, err := k.find(name)
	if errors.Is(err, ErrNotFound) {
		return nil
	}
	if err != nil {
		return err
	}
	if _, err := unix.KeyctlInt(unix.KEYCTL_INVALIDATE, id, 0, 0, 0); err != nil {
		return fmt.Errorf("kernel keyring: invalidate: %w", err)
	}
	return nil
}
