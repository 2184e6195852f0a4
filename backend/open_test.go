package backend

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestOpen(t *testing.T) {
	o, err := Open("mem:1M", Options{})
	if err != nil || o.Backend.Size() != 1<<20 {
		t.Fatalf("mem: %v", err)
	}
	o.Close()
	p := filepath.Join(t.TempDir(), "f")
	os.WriteFile(p, make([]byte, 8192), 0o600)
	o, err = Open("file:"+p, Options{ReadOnly: true})
	if err != nil || o.Backend.Size() != 8192 {
		t.Fatalf("file: %v", err)
	}
	if err := o.Close(); err != nil {
		t.Fatal(err)
	}
	for spec, want := range map[string]string{
		"mem:":             "want [rbd:]pool/image",
		"mem":              "without a cluster registry",
		"mem:lots":         "bad size",
		"nbd:pool/img":     "unknown kind",
		"rbd:a/b/c/d":      "bad image spec",
		"mem:1M@x":         "bad size",
		"file:/nonexist/x": "no such file",
	} {
		if _, err := Open(spec, Options{}); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Open(%q): %v, want %q", spec, err, want)
		}
	}
}
