package control

import (
	"os/exec"
	"strings"
	"testing"
)

// The daemon inherits from startFlusher transparent huge pages off, from
// its first instruction. (Its PR_SET_IO_FLUSHER is checked in the VM,
// e2e scenario a: not every kernel tests run on lets us set it.)
func TestStartFlusherNoTHP(t *testing.T) {
	cmd := exec.Command("grep", "THP_enabled", "/proc/self/status")
	var out strings.Builder
	cmd.Stdout = &out
	if err := startFlusher(cmd); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		t.Skipf("no THP_enabled in /proc/self/status: %v", err)
	}
	if f := strings.Fields(out.String()); len(f) != 2 || f[1] != "0" {
		t.Errorf("child has %q, want THP_enabled 0", out.String())
	}
}
