package rbdio

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
)

func TestParseAddrs(t *testing.T) {
	for in, want := range map[string][]string{
		"127.0.0.1:0/2590527697":              {"127.0.0.1:0/2590527697"},
		"[v2:10.0.0.1:0/77,v1:10.0.0.1:0/77]": {"10.0.0.1:0/77"},
		"[v2:[fd00::1]:0/9,v1:[fd00::1]:0/9]": {"[fd00::1]:0/9"},
		"":                                    nil,
		"[any:192.168.1.2:0/5, v1:192.168.1.3:0/5, garbage]": {"192.168.1.2:0/5", "192.168.1.3:0/5"},
	} {
		if got := ParseAddrs(in); !slices.Equal(got, want) {
			t.Errorf("ParseAddrs(%q) = %q, want %q", in, got, want)
		}
	}
}

// holdLockEnv makes the test binary a child that takes an image's
// exclusive lock, writes, reports its session and waits to be killed.
const holdLockEnv = "RBDIO_TEST_HOLD_LOCK"

func TestHelperHoldLock(t *testing.T) {
	spec := os.Getenv(holdLockEnv)
	if spec == "" {
		t.Skip("helper process only")
	}
	sp, err := ceph.ParseImageSpec(spec)
	if err != nil {
		t.Fatal(err)
	}
	cl := NewClustersWith(SessionHooks{Opened: func(s Session) {
		fmt.Printf("session %s %s\n", s.FSID, strings.Join(s.Addrs, " "))
	}})
	im, err := Open(cl, ceph.Options{Conf: os.Getenv("CEPH_CONF"), OpTimeout: 20 * time.Second}, sp, OpenOptions{Exclusive: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := nbd.Do(im, &nbd.Request{Op: nbd.OpWrite, Data: make([]byte, 4096), Length: 4096}); err != nil {
		t.Fatal(err)
	}
	fmt.Println("held")
	time.Sleep(time.Hour)
}

// killedOwner starts a child holding spec's exclusive lock, kills it
// with SIGKILL and returns the addresses of its RADOS session.
func killedOwner(t *testing.T, spec ceph.ImageSpec) []string {
	return lockOwner(t, spec)()
}

// lockOwner starts a child holding spec's exclusive lock; kill kills it
// with SIGKILL and returns the addresses of its RADOS session.
func lockOwner(t *testing.T, spec ceph.ImageSpec) (kill func() []string) {
	cmd := exec.Command(os.Args[0], "-test.run", "^TestHelperHoldLock$", "-test.v")
	cmd.Env = append(cluster.Env(), holdLockEnv+"="+spec.String())
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var addrs []string
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) > 2 && f[0] == "session" {
			addrs = f[2:]
		}
		if sc.Text() == "held" {
			break
		}
	}
	t.Cleanup(func() { cmd.Process.Kill() })
	return func() []string {
		cmd.Process.Signal(syscall.SIGKILL)
		cmd.Wait()
		if len(addrs) == 0 {
			t.Fatal("the lock holder did not report its session")
		}
		return addrs
	}
}

// A daemon taking devices over opens their images ahead (Deferred) and,
// when the old daemon dies instead of handing over, closes them before
// reattaching. librbd takes the exclusive lock to flush, and would wait
// out the killed owner's watch (30 s) with every device still stalled:
// an unactivated image must flush and close at once.
func TestDeferredImageClosesAtOnceAfterOwnerKilled(t *testing.T) {
	spec := newImage(t, "8M")
	kill := lockOwner(t, spec)
	im, err := Open(NewClusters(), opts(), spec, OpenOptions{Exclusive: true, Deferred: true})
	if err != nil {
		t.Fatal(err)
	}
	kill()
	t0 := time.Now()
	if err := nbd.Flush(im); err != nil {
		t.Errorf("flush: %v", err)
	}
	if err := im.Close(); err != nil {
		t.Errorf("close: %v", err)
	}
	if took := time.Since(t0); took > 10*time.Second {
		t.Errorf("flush and close took %s: they waited for the dead owner's lock", took.Round(time.Millisecond))
	}
}

func TestFencedOwnersLockBreaksAtOnce(t *testing.T) {
	spec := newImage(t, "8M")
	dead := killedOwner(t, spec)
	fenced := false
	cl := NewClustersWith(SessionHooks{Opened: func(s Session) {
		for _, a := range dead {
			if err := s.Blocklist(a, time.Minute); err != nil {
				t.Error(err)
			}
		}
		fenced = true
	}})
	t0 := time.Now()
	im, err := Open(cl, opts(), spec, OpenOptions{Exclusive: true})
	if err != nil {
		t.Fatalf("exclusive open after fencing the dead owner: %v", err)
	}
	defer im.Close()
	// Unfenced, librbd waits out the dead session's watch (30 s here,
	// osd_client_watch_timeout): a take well under it is the fencing.
	took := time.Since(t0)
	t.Logf("lock taken %s after the kill", took.Round(time.Millisecond))
	if took > 15*time.Second {
		t.Errorf("the lock waited %s: the dead owner's watch was not dropped by the blocklist", took)
	}
	if !fenced {
		t.Fatal("the session hook did not run")
	}
	out, err := cluster.Ceph("osd", "blocklist", "ls")
	if err != nil || !strings.Contains(out, dead[0]) {
		t.Fatalf("blocklist: %v %s", err, out)
	}
}
