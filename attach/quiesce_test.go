package attach

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/control"
)

func TestQuiesceHookGetsDeviceAndVerb(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "calls")
	hook := filepath.Join(dir, "hook")
	os.WriteFile(hook, []byte("#!/bin/sh\necho \"$1 $2\" >> "+out+"\n[ \"$2\" != quiesce ] || [ ! -e "+dir+"/fail ]\n"), 0o755)
	rec := control.Record{Index: 3, MapOptions: control.MapOptions{QuiesceHook: hook}}
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

// TestQuiesceHookLeavingAHelperRunning: a hook that exits 0 but leaves a
// child holding its stdout counts as done when it exits, not when the
// child does (librbd's snapshot is waiting).
func TestQuiesceHookLeavingAHelperRunning(t *testing.T) {
	hook := filepath.Join(t.TempDir(), "hook")
	os.WriteFile(hook, []byte("#!/bin/sh\nsleep 60 &\necho started\n"), 0o755)
	start := time.Now()
	if _, err := RunQuiesceHook(control.Record{Index: 1, MapOptions: control.MapOptions{QuiesceHook: hook}}, true); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d > 20*time.Second {
		t.Fatalf("hook took %v: waited for its helper", d)
	}
}
