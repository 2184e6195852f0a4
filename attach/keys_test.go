package attach

import (
	"errors"
	"testing"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
	"github.com/rbd-nbd-go/rbd-nbd-go/control"
)

type mapKeys map[string]string

func (k mapKeys) Put(name string, b []byte) error { k[name] = string(b); return nil }
func (k mapKeys) Get(name string) ([]byte, error) {
	v, ok := k[name]
	if !ok {
		return nil, errors.New("no such key")
	}
	return []byte(v), nil
}
func (k mapKeys) Remove(name string) error { delete(k, name); return nil }

// The passphrase leaves the record for the keys when a device is mapped,
// comes back for a reattach, and is forgotten at unmap.
func TestPassphraseLivesInKeysNotRecords(t *testing.T) {
	keys := mapKeys{}
	m := NewManager(Config{Keys: keys})
	rec := control.Record{Index: 3, Cookie: "c1", Spec: "rbd/img",
		Encryption: ceph.Encryption{Format: "luks2", Passphrase: "pw"}}
	kept, err := m.keepPassphrase(rec)
	if err != nil || kept.Encryption.Passphrase != "" || kept.Encryption.Format != "luks2" {
		t.Fatalf("kept record %+v, %v", kept.Encryption, err)
	}
	if keys["nbd3:c1"] != "pw" {
		t.Fatalf("keys %v", keys)
	}
	back, err := m.withPassphrase(kept)
	if err != nil || back.Encryption.Passphrase != "pw" {
		t.Fatalf("restored %v, %v", back.Encryption.Passphrase != "", err)
	}
	other := kept
	other.Cookie = "c2" // another volume later mapped at the same index
	if _, err := m.withPassphrase(other); err == nil {
		t.Fatal("a key was found for another cookie")
	}
	if err := m.dropPassphrase(kept); err != nil || len(keys) != 0 {
		t.Fatalf("after drop: %v, %v", keys, err)
	}
	if _, err := m.withPassphrase(kept); err == nil {
		t.Fatal("a dropped passphrase came back")
	}
	plain := control.Record{Index: 4, Spec: "rbd/p"}
	if r, err := m.withPassphrase(plain); err != nil || r != plain {
		t.Fatalf("unencrypted record changed: %v", err)
	}
}
