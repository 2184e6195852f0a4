package daemon

import (
	"encoding/json"
	"errors"
	"log/slog"
	"os"
	"os/exec"
	"slices"
	"testing"
	"time"
)

type blocklistCall struct {
	addr   string
	expire time.Duration
}

type fakeCluster struct {
	calls []blocklistCall
	err   error
}

func (c *fakeCluster) blocklist(addr string, expire time.Duration) error {
	c.calls = append(c.calls, blocklistCall{addr, expire})
	return c.err
}

func (c *fakeCluster) addrs() []string {
	var out []string
	for _, b := range c.calls {
		out = append(out, b.addr)
	}
	return out
}

var (
	clock = time.Date(2026, 11, 26, 12, 0, 0, 0, time.UTC) // never changed
	quiet = slog.New(slog.DiscardHandler)
)

func alive(pids ...int) processProbe {
	return func(pid int, start uint64) bool { return slices.Contains(pids, pid) && start == 7 }
}

// runDaemon plays one daemon's life in dir: it starts, opens sessions
// (fsid → addrs), and stops cleanly or not. It returns what each
// session's open blocklisted.
func runDaemon(t *testing.T, dir string, pid int, probe processProbe, sessions map[string][]string, clean bool) map[string]*fakeCluster {
	t.Helper()
	f, err := newFencer(dir, sessionsFile{PID: pid, Start: 7}, probe, func() time.Time { return clock }, quiet)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]*fakeCluster{}
	for _, fsid := range slices.Sorted(func(yield func(string) bool) {
		for k := range sessions {
			if !yield(k) {
				return
			}
		}
	}) {
		c := &fakeCluster{}
		got[fsid] = c
		f.opened(fsid, sessions[fsid], c.blocklist)
	}
	if clean {
		if err := f.clean(); err != nil {
			t.Fatal(err)
		}
	}
	return got
}

func TestFenceAfterUncleanExit(t *testing.T) {
	dir := t.TempDir()
	runDaemon(t, dir, 100, alive(), map[string][]string{"A": {"1.1.1.1:0/1"}, "B": {"1.1.1.1:0/2"}}, false)
	// The next daemon reaches only cluster A at first.
	got := runDaemon(t, dir, 101, alive(), map[string][]string{"A": {"1.1.1.1:0/3"}}, false)
	if c := got["A"]; !slices.Equal(c.addrs(), []string{"1.1.1.1:0/1"}) || c.calls[0].expire != fenceExpire {
		t.Fatalf("cluster A: fenced %+v, want the dead daemon's A session for %s", c.calls, fenceExpire)
	}
	// It is killed too: the third fences its A session and the first
	// one's B session, still owed, and nothing twice.
	got = runDaemon(t, dir, 102, alive(), map[string][]string{"A": {"1.1.1.1:0/4"}, "B": {"1.1.1.1:0/5"}}, true)
	if a, b := got["A"].addrs(), got["B"].addrs(); !slices.Equal(a, []string{"1.1.1.1:0/3"}) || !slices.Equal(b, []string{"1.1.1.1:0/2"}) {
		t.Fatalf("third daemon fenced A %q, B %q", a, b)
	}
	// It stopped cleanly: the fourth fences nothing.
	got = runDaemon(t, dir, 103, alive(), map[string][]string{"A": {"1.1.1.1:0/6"}, "B": {"1.1.1.1:0/7"}}, false)
	for fsid, c := range got {
		if len(c.calls) > 0 {
			t.Errorf("after a clean stop, cluster %s fenced %q", fsid, c.addrs())
		}
	}
}

func TestNeverFenceALiveDaemon(t *testing.T) {
	dir := t.TempDir()
	runDaemon(t, dir, 100, alive(), map[string][]string{"A": {"1.1.1.1:0/1"}}, false)
	// pid 100 still runs with the recorded start time.
	got := runDaemon(t, dir, 101, alive(100), map[string][]string{"A": {"1.1.1.1:0/2"}}, false)
	if len(got["A"].calls) > 0 {
		t.Fatalf("fenced a live daemon: %q", got["A"].addrs())
	}
	// A reused pid (another start time) is not the daemon.
	runDaemon(t, dir, 102, alive(), map[string][]string{"A": {"1.1.1.1:0/3"}}, false)
	probe := func(pid int, start uint64) bool { return pid == 102 && start == 8 }
	got = runDaemon(t, dir, 103, probe, map[string][]string{"A": {"1.1.1.1:0/4"}}, false)
	if !slices.Equal(got["A"].addrs(), []string{"1.1.1.1:0/3"}) {
		t.Fatalf("pid reused by another process: fenced %q", got["A"].addrs())
	}
}

func TestFenceNeverOwnSessionAndGivesUpOnErrors(t *testing.T) {
	dir := t.TempDir()
	runDaemon(t, dir, 100, alive(), map[string][]string{"A": {"1.1.1.1:0/1", "1.1.1.1:0/9"}}, false)
	f, err := newFencer(dir, sessionsFile{PID: 101, Start: 7}, alive(), func() time.Time { return clock }, quiet)
	if err != nil {
		t.Fatal(err)
	}
	c := &fakeCluster{err: errors.New("access denied")}
	f.opened("A", []string{"1.1.1.1:0/9"}, c.blocklist) // same address as a recorded one
	if !slices.Equal(c.addrs(), []string{"1.1.1.1:0/1"}) {
		t.Fatalf("fenced %q: want only the dead address, never our own", c.addrs())
	}
	// A failed blocklist is not retried on every session: the lock is
	// then broken when the watch times out, as without fencing.
	c2 := &fakeCluster{}
	f.opened("A", []string{"1.1.1.1:0/10"}, c2.blocklist)
	if len(c2.calls) > 0 {
		t.Fatalf("retried %q", c2.addrs())
	}
}

func TestFenceWindowAndClosedSessions(t *testing.T) {
	dir := t.TempDir()
	f, err := newFencer(dir, sessionsFile{PID: 100, Start: 7}, alive(), func() time.Time { return clock }, quiet)
	if err != nil {
		t.Fatal(err)
	}
	f.opened("A", []string{"1.1.1.1:0/1"}, (&fakeCluster{}).blocklist)
	f.opened("A", []string{"1.1.1.1:0/2"}, (&fakeCluster{}).blocklist)
	f.closed([]string{"1.1.1.1:0/1"}) // shut down cleanly: its watches are gone
	f.opened("B", []string{"1.1.1.1:0/3"}, (&fakeCluster{}).blocklist)
	// Killed. The next daemon reaches A only; B's session is owed.
	got := runDaemon(t, dir, 101, alive(), map[string][]string{"A": {"1.1.1.1:0/4"}}, false)
	if !slices.Equal(got["A"].addrs(), []string{"1.1.1.1:0/2"}) {
		t.Fatalf("fenced %q: want only the session still open", got["A"].addrs())
	}
	// Past the window nothing is owed any more.
	later := func() time.Time { return clock.Add(fenceWindow + time.Minute) }
	f, err = newFencer(dir, sessionsFile{PID: 102, Start: 7}, alive(), later, quiet)
	if err != nil {
		t.Fatal(err)
	}
	c := &fakeCluster{}
	f.opened("B", []string{"1.1.1.1:0/5"}, c.blocklist)
	if len(c.calls) > 0 {
		t.Fatalf("fenced %q an hour after", c.addrs())
	}
}

func TestProcAlive(t *testing.T) {
	self := selfProcess()
	if self.Start == 0 || !procAlive(self.PID, self.Start) || procAlive(self.PID, self.Start+1) {
		t.Fatalf("procAlive on ourselves (%+v)", self)
	}
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	if procAlive(cmd.Process.Pid, 0) {
		t.Fatal("an exited child counts as alive")
	}
	if _, err := os.Stat("/proc/self/stat"); err != nil {
		t.Skip("no procfs")
	}
}

// TestEarlySessionsWaitForTheFencer: sessions opened before the state
// directory is ours (images opened ahead of a handover) are neither
// recorded nor used to fence until the fencer exists; then a dead
// predecessor's sessions are fenced through them before any lock is
// asked for, and a session closed meanwhile is forgotten.
func TestEarlySessionsWaitForTheFencer(t *testing.T) {
	dir := t.TempDir()
	runDaemon(t, dir, 100, alive(), map[string][]string{"A": {"1.1.1.1:0/1"}}, false)
	var e earlySessions
	early, gone := &fakeCluster{}, &fakeCluster{}
	fenced5 := e.opened("A", []string{"1.1.1.1:0/5"}, early.blocklist)
	fenced6 := e.opened("A", []string{"1.1.1.1:0/6"}, gone.blocklist)
	e.closed([]string{"1.1.1.1:0/6"})
	<-fenced6 // closed, never fenced through: nothing waits for it
	select {
	case <-fenced5:
		t.Fatal("a session counted as fenced before the directory was ours")
	case <-time.After(50 * time.Millisecond):
	}
	if len(early.calls) != 0 {
		t.Fatalf("fenced before the directory was ours: %+v", early.calls)
	}
	f, err := newFencer(dir, sessionsFile{PID: 101, Start: 7}, alive(), func() time.Time { return clock }, quiet)
	if err != nil {
		t.Fatal(err)
	}
	e.attach(f)
	<-fenced5 // its images may lock and write from here
	if !slices.Equal(early.addrs(), []string{"1.1.1.1:0/1"}) || len(gone.calls) != 0 {
		t.Fatalf("fenced through the early session %v, the closed one %v; want the dead daemon's", early.addrs(), gone.addrs())
	}
	later := &fakeCluster{}
	<-e.opened("A", []string{"1.1.1.1:0/7"}, later.blocklist)
	var rec sessionsFile
	b, _ := os.ReadFile(dir + "/sessions.json")
	json.Unmarshal(b, &rec)
	if len(rec.Sessions) != 2 || !slices.Equal(rec.Sessions[0].Addrs, []string{"1.1.1.1:0/5"}) || len(later.calls) != 0 {
		t.Fatalf("recorded %+v; want the early and the later session, the dead one fenced once", rec.Sessions)
	}
}

// TestCleanRecordIsFinal: after a handover the old daemon closes its
// images (their sessions' Closed hooks) while the new one has written
// its own record: the old fencer, once clean, writes nothing more.
func TestCleanRecordIsFinal(t *testing.T) {
	dir := t.TempDir()
	old, err := newFencer(dir, sessionsFile{PID: 100, Start: 7}, alive(), func() time.Time { return clock }, quiet)
	if err != nil {
		t.Fatal(err)
	}
	old.opened("A", []string{"1.1.1.1:0/1"}, (&fakeCluster{}).blocklist)
	if err := old.clean(); err != nil {
		t.Fatal(err)
	}
	// The new daemon takes the directory over.
	nf, err := newFencer(dir, sessionsFile{PID: 101, Start: 8}, alive(), func() time.Time { return clock }, quiet)
	if err != nil {
		t.Fatal(err)
	}
	c := &fakeCluster{}
	nf.opened("A", []string{"1.1.1.1:0/2"}, c.blocklist)
	old.closed([]string{"1.1.1.1:0/1"})
	var rec sessionsFile
	b, _ := os.ReadFile(dir + "/sessions.json")
	json.Unmarshal(b, &rec)
	if rec.PID != 101 || rec.Clean || len(rec.Sessions) != 1 || len(c.calls) != 0 {
		t.Fatalf("record %+v, fenced %q; want the new daemon's, nothing fenced", rec, c.addrs())
	}
}
