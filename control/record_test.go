package control

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
)

func TestValidate(t *testing.T) {
	ok := Record{Index: AnyIndex, Spec: "pool/img", MapOptions: MapOptions{Connections: 4}, PVC: "data-0.x", PVCNamespace: "shop"}
	if err := ok.Validate(); err != nil {
		t.Fatal(err)
	}
	for want, mod := range map[string]func(*Record){
		"connections 0":       func(r *Record) { r.Connections = 0 },
		"connections 65":      func(r *Record) { r.Connections = 65 },
		"negative":            func(r *Record) { r.IOTimeout = -time.Second },
		"block size 3000":     func(r *Record) { r.BlockSize = 3000 },
		"bad image spec":      func(r *Record) { r.Spec = "a/b/c/d" },
		"unknown kind":        func(r *Record) { r.Spec = "nbd:x" },
		"RBD images only":     func(r *Record) { r.Spec, r.Exclusive = "mem:1M", true },
		"encryption format":   func(r *Record) { r.Encryption = ceph.Encryption{Format: "rot13", Passphrase: "x"} },
		"needs an encryption": func(r *Record) { r.Encryption = ceph.Encryption{Passphrase: "x"} },
		"needs a passphrase":  func(r *Record) { r.Encryption = ceph.Encryption{Format: "luks"} },
		"bad device index":    func(r *Record) { r.Index = -7 },
		"bad PVC":             func(r *Record) { r.PVC = "Data Vol" },
		"bad PVC ":            func(r *Record) { r.PVC, r.PVCNamespace = "data", strings.Repeat("n", 64) },
	} {
		r := ok
		mod(&r)
		if err := r.Validate(); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: got %v", want, err)
		}
	}
}

func TestPublicDropsSecrets(t *testing.T) {
	r := Record{Ceph: ceph.Options{Key: "AQD"}, Encryption: ceph.Encryption{Format: "luks", Passphrase: "p"}}
	if p := r.Public(); p.Ceph.Key != "" || p.Encryption.Passphrase != "" || p.Encryption.Format != "luks" {
		t.Fatalf("%+v", p)
	}
}

func TestSentinelsCrossTheSocket(t *testing.T) {
	for _, s := range []error{ErrBusy, ceph.ErrImageNotFound, ceph.ErrPoolNotFound, ceph.ErrPermission,
		ceph.ErrLocked, ceph.ErrUnreachable, ceph.ErrImageInUse} {
		err := Failure(fmt.Errorf("wrapped: %w", s)).Err()
		if !errors.Is(err, s) || !strings.Contains(err.Error(), "wrapped: ") {
			t.Errorf("%v came back as %v", s, err)
		}
	}
	if err := Failure(ErrNotMapped).Err(); !errors.Is(err, ErrNotMapped) {
		t.Errorf("not mapped came back as %v", err)
	}
	if err := Failure(errors.New("other")).Err(); err == nil || err.Error() != "other" {
		t.Errorf("plain error came back as %v", err)
	}
}
