package rbdio

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
)

func TestEncryptionLUKS(t *testing.T) {
	spec := newImage(t, "64M")
	pass := filepath.Join(t.TempDir(), "pass")
	os.WriteFile(pass, []byte("correct horse"), 0o600)
	if out, err := cluster.Rbd("encryption", "format", spec.String(), "luks1", pass); err != nil {
		t.Fatalf("rbd encryption format: %v %s", err, out)
	}
	cl := NewClusters()
	im := open(t, cl, spec, OpenOptions{Encryption: ceph.Encryption{Format: "luks", Passphrase: "correct horse"}})
	if im.Size() == 0 || im.Size() >= 64<<20 {
		t.Fatalf("decrypted size %d: the LUKS header must be hidden", im.Size())
	}
	plain := bytes.Repeat([]byte("secret data 0123"), 256)
	if err := do(t, im, nbd.OpWrite, nbd.ReqFUA, 0, plain, len(plain)); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(plain))
	if err := do(t, im, nbd.OpRead, 0, 0, got, len(got)); err != nil || !bytes.Equal(got, plain) {
		t.Fatalf("read back through encryption: %v", err)
	}
	if raw := export(t, spec); bytes.Contains(raw, []byte("secret data 0123")) {
		t.Fatal("plaintext reached the cluster")
	}
	im.Close()
	_, err := Open(cl, opts(), spec, OpenOptions{Encryption: ceph.Encryption{Format: "luks1", Passphrase: "wrong"}})
	if !errors.Is(err, ceph.ErrBadPassphrase) || strings.Contains(err.Error(), "wrong\"") {
		t.Fatalf("wrong passphrase: %v", err)
	}
	if _, err := Open(cl, opts(), spec, OpenOptions{Encryption: ceph.Encryption{Format: "rot13", Passphrase: "x"}}); err == nil {
		t.Fatal("unknown format accepted")
	}
}

func TestQuiesceHookAroundSnapshot(t *testing.T) {
	spec := newImage(t, "16M")
	h := &quiesceRecorder{}
	open(t, NewClusters(), spec, OpenOptions{OnQuiesce: h.hook})
	if out, err := cluster.Rbd("snap", "create", spec.String()+"@s1"); err != nil {
		t.Fatalf("snap create: %v %s", err, out)
	}
	if calls := h.calls(); len(calls) != 2 || !calls[0] || calls[1] {
		t.Fatalf("hook calls %v, want [true false]", calls)
	}
	h.failNext()
	if _, err := cluster.Rbd("snap", "create", spec.String()+"@s2"); err == nil {
		t.Fatal("snapshot taken although the quiesce hook failed")
	}
}

// quiesceRecorder is a quiesce hook that records its calls and can be
// made to fail a freeze.
type quiesceRecorder struct {
	mu   sync.Mutex
	seen []bool
	fail bool
}

func (h *quiesceRecorder) hook(q bool) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.seen = append(h.seen, q)
	if q && h.fail {
		return errors.New("freeze failed")
	}
	return nil
}

func (h *quiesceRecorder) calls() []bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]bool(nil), h.seen...)
}

func (h *quiesceRecorder) failNext() {
	h.mu.Lock()
	h.fail = true
	h.mu.Unlock()
}

// An image formatted by FormatEncryption: a clone of its snapshot opens
// with the parent's passphrase (librbd 16.2 has no per-clone key), stays
// encrypted, and keeps its data through a resize of the raw image (the
// decrypted size follows, less the 16 MiB header) and a flatten.
func TestEncryptionFormatCloneResizeFlatten(t *testing.T) {
	spec := newImage(t, "64M")
	cl := NewClusters()
	if err := cl.FormatEncryption(opts(), spec, []byte("pw")); err != nil {
		t.Fatal(err)
	}
	if raw := export(t, spec); !bytes.HasPrefix(raw, []byte("LUKS\xba\xbe")) {
		t.Fatalf("no LUKS header at offset 0: %q", raw[:8])
	}
	im := open(t, cl, spec, OpenOptions{Encryption: ceph.Encryption{Format: "luks2", Passphrase: "pw"}})
	if im.Size() != 48<<20 {
		t.Fatalf("decrypted size %d, want 64 MiB less the 16 MiB header", im.Size())
	}
	plain := bytes.Repeat([]byte("secret data 0123"), 256)
	if err := do(t, im, nbd.OpWrite, nbd.ReqFUA, 0, plain, len(plain)); err != nil {
		t.Fatal(err)
	}
	im.Close()
	if out, err := cluster.Rbd("snap", "create", spec.String()+"@s"); err != nil {
		t.Fatal(out)
	}
	child := spec
	child.Image = spec.Image + "-c"
	if out, err := cluster.Rbd("clone", "--rbd-default-clone-format", "2", spec.String()+"@s", child.String()); err != nil {
		t.Fatal(out)
	}
	im2, err := Open(cl, opts(), child, OpenOptions{Encryption: ceph.Encryption{Format: "luks2", Passphrase: "pw"}})
	if err != nil {
		t.Fatalf("open clone: %v", err)
	}
	if im2.Size() != 48<<20 {
		t.Fatalf("clone's decrypted size %d", im2.Size())
	}
	got := make([]byte, len(plain))
	if err := do(t, im2, nbd.OpRead, 0, 0, got, len(got)); err != nil || !bytes.Equal(got, plain) {
		t.Fatalf("clone read: %v %q", err, got[:32])
	}
	p2 := bytes.Repeat([]byte("child data 45678"), 256)
	if err := do(t, im2, nbd.OpWrite, nbd.ReqFUA, 4096, p2, len(p2)); err != nil {
		t.Fatal(err)
	}
	if err := do(t, im2, nbd.OpRead, 0, 0, got, len(got)); err != nil || !bytes.Equal(got, plain) {
		t.Fatalf("clone read2: %v %q", err, got[:32])
	}
	im2.Close()
	if raw := export(t, child); bytes.Contains(raw, []byte("child data 45678")) {
		t.Fatal("plaintext in clone")
	}
	// resize raw image and reopen
	if out, err := cluster.Rbd("resize", "--size", "128M", child.String()); err != nil {
		t.Fatal(out)
	}
	im3, err := Open(cl, opts(), child, OpenOptions{Encryption: ceph.Encryption{Format: "luks2", Passphrase: "pw"}})
	if err != nil {
		t.Fatal(err)
	}
	if im3.Size() != 112<<20 {
		t.Fatalf("resized clone's decrypted size %d", im3.Size())
	}
	im3.Close()
	if out, err := cluster.Rbd("flatten", child.String()); err != nil {
		t.Fatal(out)
	}
	im4, err := Open(cl, opts(), child, OpenOptions{Encryption: ceph.Encryption{Format: "luks2", Passphrase: "pw"}})
	if err != nil {
		t.Fatal(err)
	}
	if err := do(t, im4, nbd.OpRead, 0, 0, got, len(got)); err != nil || !bytes.Equal(got, plain) {
		t.Fatalf("flat read: %v %q", err, got[:32])
	}
	im4.Close()
}
