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
	if err == nil || !strings.Contains(err.Error(), "wrong passphrase") || strings.Contains(err.Error(), "wrong\"") {
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
