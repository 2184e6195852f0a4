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
// near the kernel's 30 s timer (what a restart without the handover
// costs, TestRestartSurvival).
func TestUpgradeHandover(t *testing.T) {
	r := newVolumeRig(t)
	r.create("pvc-upgrade", 256<<20, fsCap("ext4", rwo))
	r.attach()
	target := r.publish("a", false)
	f := fio(t, filepath.Join(target, "f"), "32M")
	stop := make(chan struct{})
	stall := make(chan time.Duration, 1)
	werr := make(chan error, 1)
	go func() { d, err := writer(filepath.Join(target, "w"), stop); stall <- d; werr <- err }()
	time.Sleep(3 * time.Second)

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
	if !f.running() {
		t.Fatal("fio ended before the handover was over: nothing was tested under I/O")
	}
	out, ok := f.wait()
	close(stop)
	longest := <-stall
	if err := <-werr; err != nil {
		t.Fatalf("the application saw an I/O error: %v", err)
	}
	if !ok {
		t.Fatalf("fio across the handover:\n%s", out)
	}
	if !mountedRW(t, target) {
		t.Fatal("the filesystem is no longer read-write")
	}
	t.Logf("upgrade: longest write+fdatasync across the handover: %s", longest.Round(time.Millisecond))
	log, _ := os.ReadFile(filepath.Join(r.p.dir, "state", "daemon.log"))
	if !strings.Contains(string(log), "handed every device over") || !strings.Contains(string(log), "adopted from the previous daemon") {
		t.Fatalf("no handover in the daemon log:\n%s", tail(string(log), 30))
	}
	// Well under the kernel's 30 s timer, which a dropped socket costs.
	if longest > 10*time.Second {
		t.Errorf("a write waited %s across the handover", longest.Round(time.Millisecond))
	}
	r.unpublish(target)
	r.detach()
}
