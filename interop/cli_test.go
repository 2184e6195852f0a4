package interop

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestCLIMisuse: every mistake gets one line on stderr and a non-zero exit.
func TestCLIMisuse(t *testing.T) {
	dir := t.TempDir()
	notSock := filepath.Join(dir, "plain")
	os.WriteFile(notSock, []byte("x"), 0o600)
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"serve"}, "accepts 1 arg"},
		{[]string{"serve", "--socket", filepath.Join(dir, "s"), "bogus:1"}, "unknown kind"},
		{[]string{"serve", "--socket", filepath.Join(dir, "s"), "mem:0"}, "bad size"},
		{[]string{"serve", "--socket", filepath.Join(dir, "s"), "file:/nonexistent/disk"}, "no such file"},
		{[]string{"serve", "--socket", "a", "--listen", "1", "mem:1M"}, "none of the others can be"},
		{[]string{"serve", "mem:1M"}, "one of --socket or --listen is required"},
		{[]string{"serve", "--socket", notSock, "mem:1M"}, "not a socket"},
		{[]string{"serve", "--listen", "nowhere", "mem:1M"}, "want HOST:PORT"},
		{[]string{"serve", "--bogus-flag", "mem:1M"}, "unknown flag"},
		{[]string{"frobnicate"}, "unknown command"},
	}
	for _, tc := range cases {
		cmd := client(t, time.Minute, binary, tc.args...)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		err := cmd.Run()
		if err == nil {
			t.Errorf("%v: exit 0", tc.args)
			continue
		}
		msg := stderr.String()
		if strings.Count(msg, "\n") != 1 || !strings.HasPrefix(msg, "rbd-nbd-go: ") || !strings.Contains(msg, tc.want) {
			t.Errorf("%v: stderr %q, want one line containing %q", tc.args, msg, tc.want)
		}
	}
}

// TestRbdNbdFeatureProbe: installed as rbd-nbd, the binary passes
// ceph-csi's start-up probe (internal/rbd/rbd_attach.go): `rbd-nbd
// --help` exits 0, prints nothing on stderr, and names --cookie on
// stdout, so ceph-csi turns on the nbd mounter with cookies.
func TestRbdNbdFeatureProbe(t *testing.T) {
	link := filepath.Join(t.TempDir(), "rbd-nbd")
	if err := os.Symlink(binary, link); err != nil {
		t.Fatal(err)
	}
	cmd := client(t, time.Minute, link, "--help")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil || stderr.Len() != 0 || !strings.Contains(stdout.String(), "--cookie") {
		t.Fatalf("probe: %v, stderr %q, --cookie on stdout: %v", err, stderr.String(), strings.Contains(stdout.String(), "--cookie"))
	}
}
