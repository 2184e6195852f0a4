package backend

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestParseSize(t *testing.T) {
	good := map[string]uint64{"4096": 4096, "512K": 512 << 10, "64M": 64 << 20, "1G": 1 << 30,
		"1GiB": 1 << 30, "2t": 2 << 40, "1P": 1 << 50, "10MB": 10 << 20}
	for s, want := range good {
		if got, err := ParseSize(s); err != nil || got != want {
			t.Errorf("ParseSize(%q) = %d, %v; want %d", s, got, err, want)
		}
	}
	for _, s := range []string{"", "0", "G", "-1G", "1X", "99999999999P", "1.5G"} {
		if _, err := ParseSize(s); err == nil {
			t.Errorf("ParseSize(%q) accepted", s)
		}
	}
}

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
