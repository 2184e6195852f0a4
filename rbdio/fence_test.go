package rbdio

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync/atomic"
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
	cl := NewClustersWith(SessionHooks{Opened: func(s Session) <-chan struct{} {
		fmt.Printf("session %s %s\n", s.FSID, strings.Join(s.Addrs, " "))
		return nil
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
	// The fence runs beside the open, as the node daemon's does, and
	// late: the open must wait for it before it asks for the lock.
	var fenced atomic.Bool
	cl := NewClustersWith(SessionHooks{Opened: func(s Session) <-chan struct{} {
		done := make(chan struct{})
		go func() {
			defer close(done)
			time.Sleep(time.Second)
			for _, a := range dead {
				if err := s.Blocklist(a, time.Minute); err != nil {
					t.Error(err)
				}
			}
			fenced.Store(true)
		}()
		return done
	}})
	t0 := time.Now()
	im, err := Open(cl, opts(), spec, OpenOptions{Exclusive: true})
	if err != nil {
		t.Fatalf("exclusive open after fencing the dead owner: %v", err)
	}
	defer im.Close()
	if !fenced.Load() {
		t.Fatal("the open returned before its session's fence ended")
	}
	// Unfenced, librbd waits out the dead session's watch (30 s here,
	// osd_client_watch_timeout): a take well under it is the fencing.
	took := time.Since(t0)
	t.Logf("lock taken %s after the kill", took.Round(time.Millisecond))
	if took > 15*time.Second {
		t.Errorf("the lock waited %s: the dead owner's watch was not dropped by the blocklist", took)
	}
	out, err := cluster.Ceph("osd", "blocklist", "ls")
	if err != nil || !strings.Contains(out, dead[0]) {
		t.Fatalf("blocklist: %v %s", err, out)
	}
}

// TestDeferredOpenFencesInActivate: an open ahead of a handover runs
// before the new daemon's fencer exists, so it must not wait for its
// session's fence; taking the lock (Activate) must.
func TestDeferredOpenFencesInActivate(t *testing.T) {
	spec := newImage(t, "8M")
	gate := make(chan struct{})
	cl := NewClustersWith(SessionHooks{Opened: func(Session) <-chan struct{} { return gate }})
	im, err := Open(cl, opts(), spec, OpenOptions{Exclusive: true, Deferred: true})
	if err != nil {
		t.Fatalf("a deferred open waited for, or failed before, its session's fence: %v", err)
	}
	defer im.Close()
	activated := make(chan error, 1)
	go func() { activated <- im.Activate() }()
	select {
	case err := <-activated:
		t.Fatalf("Activate took the lock before the session's fence ended (err %v)", err)
	case <-time.After(500 * time.Millisecond):
	}
	close(gate)
	if err := <-activated; err != nil {
		t.Fatalf("Activate after the fence: %v", err)
	}
}

// TestOpenWaitsForFence: an open that is not deferred returns only once
// its session's fence has ended (it took the lock after it), while its
// header reads went ahead.
func TestOpenWaitsForFence(t *testing.T) {
	spec := newImage(t, "8M")
	gate := make(chan struct{})
	var closed atomic.Bool
	cl := NewClustersWith(SessionHooks{Opened: func(Session) <-chan struct{} {
		time.AfterFunc(time.Second, func() { closed.Store(true); close(gate) })
		return gate
	}})
	im, err := Open(cl, opts(), spec, OpenOptions{Exclusive: true})
	if err != nil {
		t.Fatal(err)
	}
	defer im.Close()
	if !closed.Load() {
		t.Fatal("the open took its lock before its session's fence ended")
	}
}

// TestFenceOutlivesAFailedOpen: a fence still running when the only open
// on its session fails keeps the connection up until it ends (the open's
// release must not shut it down under the blocklist), and lets it go
// then.
func TestFenceOutlivesAFailedOpen(t *testing.T) {
	done := make(chan struct{})
	var blErr error
	cl := NewClustersWith(SessionHooks{Opened: func(s Session) <-chan struct{} {
		go func() {
			defer close(done)
			time.Sleep(500 * time.Millisecond)
			blErr = s.Blocklist("127.0.0.1:0/1", time.Minute)
		}()
		return done
	}})
	spec := newImage(t, "8M")
	spec.Image += "-missing"
	if _, err := Open(cl, opts(), spec, OpenOptions{Exclusive: true}); err == nil {
		t.Fatal("opened an image that does not exist")
	}
	<-done
	if blErr != nil {
		t.Fatalf("the fence, after the open failed: %v", blErr)
	}
	for deadline := time.Now().Add(5 * time.Second); len(cl.Connections()) > 0; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the connection outlived its fence: %+v", cl.Connections())
		}
	}
}
