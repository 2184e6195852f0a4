package keyring

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"testing"
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
