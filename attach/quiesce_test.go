package attach

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestQuiesceHookGetsDeviceAndVerb(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "calls")
	hook := filepath.Join(dir, "hook")
	os.WriteFile(hook, []byte("#!/bin/sh\necho \"$1 $2\" >> "+out+"\n[ \"$2\" != quiesce ] || [ ! -e "+dir+"/fail ]\n"), 0o755)
	rec := Record{Index: 3, QuiesceHook: hook}
	if target, err := RunQuiesceHook(rec, true); err != nil || target != hook {
		t.Fatal(target, err)
	}
	if _, err := RunQuiesceHook(rec, false); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(out)
	if string(b) != "/dev/nbd3 quiesce\n/dev/nbd3 unquiesce\n" {
		t.Fatalf("hook calls %q", b)
	}
	os.WriteFile(filepath.Join(dir, "fail"), nil, 0o600)
	if _, err := RunQuiesceHook(rec, true); err == nil || !strings.Contains(err.Error(), "quiesce hook") {
		t.Fatalf("failing hook: %v", err)
	}
}
