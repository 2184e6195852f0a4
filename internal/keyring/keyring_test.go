package keyring

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func TestPutGetRemove(t *testing.T) {
	k := Kernel{Prefix: fmt.Sprintf("rbd-nbd-go-test-%d:", os.Getpid())}
	secret := bytes.Repeat([]byte("s3cret"), 200) // longer than Get's first buffer
	if err := k.Put("a", secret); err != nil {
		t.Skipf("no kernel keyring here: %v", err)
	}
	t.Cleanup(func() { k.Remove("a") })
	got, err := k.Get("a")
	if err != nil || !bytes.Equal(got, secret) {
		t.Fatalf("get: %v (%d bytes)", err, len(got))
	}
	if err := k.Put("a", []byte("new")); err != nil {
		t.Fatal(err)
	}
	if got, err := k.Get("a"); err != nil || string(got) != "new" {
		t.Fatalf("replaced key reads %q, %v", got, err)
	}
	if err := k.Remove("a"); err != nil {
		t.Fatal(err)
	}
	if _, err := k.Get("a"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("removed key: %v", err)
	}
	if err := k.Remove("a"); err != nil {
		t.Fatalf("removing a missing key: %v", err)
	}
	if _, err := k.Get("never"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("missing key: %v", err)
	}
}

// In a container the process starts with a fresh session keyring that is
// not linked to the user keyring (runc makes one per container): keys
// must still be stored, read back by a later process, and removed.
func TestFreshSessionKeyring(t *testing.T) {
	k := Kernel{Prefix: fmt.Sprintf("rbd-nbd-go-test-%d:", os.Getpid())}
	done := make(chan error, 1)
	go func() {
		// Never unlocked: the thread's keyrings change, and it ends
		// with this goroutine.
		runtime.LockOSThread()
		if _, err := unix.KeyctlJoinSessionKeyring(fmt.Sprintf("rbd-nbd-go-test-session-%d", os.Getpid())); err != nil {
			done <- fmt.Errorf("skip: %w", err)
			return
		}
		if err := k.Put("c", []byte("pw")); err != nil {
			done <- err
			return
		}
		done <- nil
	}()
	if err := <-done; err != nil {
		if strings.HasPrefix(err.Error(), "skip: ") {
			t.Skip(err)
		}
		t.Fatalf("put from a fresh session keyring: %v", err)
	}
	// Another thread of another session (a restarted daemon) reads it.
	if got, err := k.Get("c"); err != nil || string(got) != "pw" {
		t.Fatalf("get: %q, %v", got, err)
	}
	if err := k.Remove("c"); err != nil {
		t.Fatal(err)
	}
	if _, err := k.Get("c"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("after remove: %v", err)
	}
}
