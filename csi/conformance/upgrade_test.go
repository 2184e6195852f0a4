package conformance

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestUpgradeHandover: a second plugin starts beside the running one on
// the same state directory, as a DaemonSet's new pod does with maxSurge,
// while a published ext4 volume takes fio verify and an fdatasync loop.
// Its daemon takes the devices over from the running daemon with the
// kernel's sockets live, and the old daemon exits; then the old plugin
// is stopped. The application must see no error and no stall anywhere
// near the 10 s request timer of CSI maps, which a restart without the
// handover costs (TestRestartSurvival: 11 s killed).
func TestUpgradeHandover(t *testing.T) {
	r := newVolumeRig(t)
	r.create("pvc-upgrade", 256<<20, fsCap("ext4", rwo))
	r.attach()
	target := r.publish("a", false)
	longest := acrossEvent(t, target, "the handover", func() {
		oldPlugin, oldDaemon := r.p.cmd, r.p.daemonPID()
		t0 := time.Now()
		r.p.start() // the new plugin; its daemon asks the running one
		for syscall.Kill(oldDaemon, 0) == nil {
			if time.Since(t0) > 2*time.Minute {
				t.Fatalf("the old daemon (pid %d) did not hand over and exit", oldDaemon)
			}
			time.Sleep(50 * time.Millisecond)
		}
		took := time.Since(t0)
		if d := r.p.daemonPID(); d == oldDaemon || d == 0 {
			t.Fatalf("the state directory's daemon is pid %d, the old one was %d", d, oldDaemon)
		}
		oldPlugin.Process.Signal(syscall.SIGTERM)
		oldPlugin.Wait()
		t.Logf("upgrade: the old daemon handed over and exited %s after the new plugin started", took.Round(time.Millisecond))
	})
	t.Logf("upgrade: longest write+fdatasync across the handover: %s", longest.Round(time.Millisecond))
	log, _ := os.ReadFile(filepath.Join(r.p.dir, "state", "daemon.log"))
	if !strings.Contains(string(log), "handed every device over") || !strings.Contains(string(log), "adopted from the previous daemon") {
		t.Fatalf("no handover in the daemon log:\n%s", tail(string(log), 30))
	}
	// Well under the 10 s timer, which a dropped socket costs.
	if longest > 5*time.Second {
		t.Errorf("a write waited %s across the handover", longest.Round(time.Millisecond))
	}
	r.unpublish(target)
	r.detach()
}
