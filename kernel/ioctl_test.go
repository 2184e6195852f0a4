package kernel

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// fakeSys makes sysfs's nbd0 directory with the given size in sectors and,
// if started, the pid attribute the kernel creates when it starts a device.
func fakeSys(t *testing.T, sectors string, started bool) *Ioctl {
	t.Helper()
	k := NewIoctl()
	k.sysDir = t.TempDir()
	dir := filepath.Join(k.sysDir, "nbd0")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	writeSys(t, k, "size", sectors)
	if started {
		writeSys(t, k, "pid", "42")
	}
	return k
}

func writeSys(t *testing.T, k *Ioctl, name, v string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(k.sysDir, "nbd0", name), []byte(v+"\n"), 0o644); err != nil {
		t.Error(err)
	}
}

// startWaiting runs waitStarted for a 128 MiB device in the background.
func startWaiting(k *Ioctl) (*doIt, chan error) {
	run := &doIt{ended: make(chan struct{})}
	res := make(chan error, 1)
	go func() { res <- k.waitStarted(0, 128<<20, run) }()
	return run, res
}

// stillWaiting fails the test if waitStarted returned within 100 ms.
func stillWaiting(t *testing.T, res chan error, why string) {
	t.Helper()
	select {
	case err := <-res:
		t.Fatalf("%s: %v", why, err)
	case <-time.After(100 * time.Millisecond):
	}
}

func TestWaitStartedWaitsForCapacityAndPid(t *testing.T) {
	k := fakeSys(t, "0", false)
	_, res := startWaiting(k)
	stillWaiting(t, res, "returned before the kernel started the device")
	writeSys(t, k, "size", "262144") // capacity first: still no pid
	stillWaiting(t, res, "returned with no pid attribute")
	writeSys(t, k, "pid", "42")
	select {
	case err := <-res:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("still waiting after the device started")
	}
}

func TestWaitStartedReportsDoItFailure(t *testing.T) {
	k := fakeSys(t, "0", false)
	run := &doIt{ended: make(chan struct{}), err: syscall.EINVAL}
	close(run.ended)
	err := k.waitStarted(0, 128<<20, run)
	if !errors.Is(err, syscall.EINVAL) || !strings.Contains(err.Error(), "/dev/nbd0: start") {
		t.Fatalf("err = %v, want the NBD_DO_IT error", err)
	}
	k = fakeSys(t, "0", false)
	ended := &doIt{ended: make(chan struct{})}
	close(ended.ended)
	if err := k.waitStarted(0, 128<<20, ended); err == nil || !strings.Contains(err.Error(), "ended the device") {
		t.Fatalf("err = %v, want 'ended the device'", err)
	}
}

func TestWaitStartedWrongSizeIsNotStarted(t *testing.T) {
	// A capacity that is not ours (another size) must not count.
	k := fakeSys(t, "2048", true)
	run, res := startWaiting(k)
	stillWaiting(t, res, "took another capacity for ours")
	close(run.ended)
	if err := <-res; err == nil {
		t.Fatal("no error after NBD_DO_IT ended")
	}
}
