package interop

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// runCLI runs the binary with a private state directory.
func runCLI(t *testing.T, state string, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	cmd := client(t, 2*time.Minute, binary, args...)
	cmd.Env = append(os.Environ(), "RBD_NBD_GO_STATE_DIR="+state)
	var o, e bytes.Buffer
	cmd.Stdout, cmd.Stderr = &o, &e
	err := cmd.Run()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return o.String(), e.String(), code
}

// TestDeviceCLIWithoutKernelNBD runs the device commands where the kernel
// has no NBD (this machine): they must fail in one clear line, leave no
// daemon behind, and keep ceph-csi's contracts (the VM scenarios cover
// the kernel path itself).
func TestDeviceCLIWithoutKernelNBD(t *testing.T) {
	if _, err := os.Stat("/sys/module/nbd"); err == nil {
		t.Skip("this kernel has NBD; the VM scenarios cover it")
	}
	state := filepath.Join(t.TempDir(), "state")

	// list-mapped with nothing mapped: empty, and no daemon started.
	out, errOut, code := runCLI(t, state, "list-mapped", "--format=json")
	if code != 0 || strings.TrimSpace(out) != "[]" || errOut != "" {
		t.Fatalf("list-mapped json: %d %q %q", code, out, errOut)
	}
	if out, _, code := runCLI(t, state, "list-mapped"); code != 0 || out != "" {
		t.Fatalf("list-mapped plain: %d %q", code, out)
	}
	if _, err := os.Stat(filepath.Join(state, "control.sock")); err == nil {
		t.Fatal("list-mapped started a daemon with nothing to serve")
	}

	// unmap of something not mapped: Ceph's exact words, distinct status.
	for _, target := range []string{"/dev/nbd3", "rbd/img", "pool/ns/img"} {
		_, errOut, code := runCLI(t, state, "unmap", target)
		if code != 3 || errOut != "rbd-nbd: "+target+" is not mapped\n" {
			t.Errorf("unmap %s: exit %d, stderr %q", target, code, errOut)
		}
	}

	// map: the daemon starts, finds no NBD, and the CLI says so in one line.
	_, errOut, code = runCLI(t, state, "map", "mem:64M")
	if code == 0 || strings.Count(errOut, "\n") != 1 || !strings.Contains(errOut, "has no NBD driver") {
		t.Fatalf("map without NBD: exit %d, stderr %q", code, errOut)
	}
	if b, _ := os.ReadFile(filepath.Join(state, "daemon.log")); !strings.Contains(string(b), "has no NBD driver") {
		t.Errorf("daemon log does not say why: %q", b)
	}
	if fi, err := os.Stat(state); err != nil || fi.Mode().Perm() != 0o700 {
		t.Errorf("state dir: %v %v", fi, err)
	}

	// Misuse: one line, non-zero, before any daemon is involved.
	key := filepath.Join(t.TempDir(), "key")
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"map", "--device", "/dev/sda", "mem:1M"}, "want /dev/nbdN"},
		{[]string{"map", "bogus:thing"}, "bad spec"},
		{[]string{"map", "mem:0"}, "bad size"},
		// control.Record.Validate, run by the client before it asks.
		{[]string{"map", "--connections", "0", "mem:1M"}, "connections 0: want 1 to 64"},
		{[]string{"map", "--block-size", "3000", "mem:1M"}, "block size 3000"},
		{[]string{"map", "--exclusive", "mem:1M"}, "RBD images only"},
		{[]string{"map", "--reattach-timeout", "-1", "mem:1M"}, "cannot be negative"},
		{[]string{"map", "--keyfile", key, "rbd/img"}, "keyfile: " + key + ": no such file"},
		{[]string{"map", "--encryption-format", "luks2", "rbd/img"}, "passphrase-file"},
		{[]string{"map", "--no-such-flag", "rbd/img"}, "unknown flag"},
		{[]string{"map"}, "accepts 1 arg"},
		{[]string{"attach", "rbd/img"}, "attach needs --device"},
		{[]string{"unmap", "/dev/nbdx"}, "want /dev/nbdN"},
		{[]string{"list-mapped", "--format", "xml"}, "bad --format"},
	}
	for _, tc := range cases {
		_, errOut, code := runCLI(t, state, tc.args...)
		if code == 0 || strings.Count(errOut, "\n") != 1 || !strings.Contains(errOut, tc.want) {
			t.Errorf("%v: exit %d, stderr %q, want one line with %q", tc.args, code, errOut, tc.want)
		}
	}
}

// TestKeyfileNeverEchoed: a key file's contents appear in no output.
func TestKeyfileNeverEchoed(t *testing.T) {
	state := filepath.Join(t.TempDir(), "state")
	key := filepath.Join(t.TempDir(), "key")
	os.WriteFile(key, []byte("AQDsecretsecretsecret==\n"), 0o600)
	_, errOut, _ := runCLI(t, state, "--keyfile", key, "map", "--device", "/dev/nbd0", "rbd/img")
	b, _ := os.ReadFile(filepath.Join(state, "daemon.log"))
	if strings.Contains(errOut+string(b), "secretsecret") {
		t.Fatalf("key leaked: %q %q", errOut, b)
	}
}
