package conformance

import (
	"strings"
	"testing"
	"time"
)

// TestWaitedAfter: a fault is charged only the part of each I/O after it
// began, and only for I/O completing in its window.
func TestWaitedAfter(t *testing.T) {
	t0 := time.Unix(1000, 0)
	at := func(s float64) time.Time { return t0.Add(time.Duration(s * float64(time.Second))) }
	slowest := map[int64]completion{}
	put := func(done, took float64) {
		c := completion{at(done), time.Duration(took * float64(time.Second))}
		if c.took > slowest[c.at.Unix()].took {
			slowest[c.at.Unix()] = c
		}
	}
	put(-1, 0.2)   // before the fault: not in its window
	put(2, 0.1)    // quick, after it
	put(6.3, 16.3) // began 10 s before the fault, done 6.3 s after it
	put(9, 9.5)    // in flight when the fault came (0.5 s old), done 9 s after
	put(25, 12)    // begun at +13 s, after the fault recovered (+10 s)
	put(40, 30)    // the next fault's: out of this window
	from, to, recovered := at(0), at(30), at(10)
	if d, when := slowestIn(slowest, from, to); d != 16300*time.Millisecond || !when.Equal(at(6.3)) {
		t.Errorf("slowest in the window: %s at %s, want 16.3s at +6.3s", d, when.Sub(t0))
	}
	if w := waitedAfter(slowest, from, to, recovered); w != 9*time.Second {
		t.Errorf("waited after the fault: %s, want 9s (the request in flight; the early one only 6.3s, the late one not the fault's)", w)
	}
	if w := waitedAfter(slowest, from, to, at(12.5)); w != 12*time.Second {
		t.Errorf("waited after the fault: %s, want 12s (the late one may have begun within a second of the recovery)", w)
	}
	if w := waitedAfter(slowest, at(31), at(35), at(35)); w != 0 {
		t.Errorf("an empty window waited %s", w)
	}
}

// TestReportBaseline: the report states the fault-free floor when the
// soak had a window for it, and nothing when it had none.
func TestReportBaseline(t *testing.T) {
	t0 := time.Unix(1000, 0)
	f := []fault{{kind: fDaemonKill, start: t0.Add(40 * time.Second), at: 40 * time.Second}}
	got := report(1, time.Minute, []string{"v"}, f, nil, soakTargets,
		baseline{from: t0.Add(5 * time.Second), to: t0.Add(40 * time.Second), slowest: 1260 * time.Millisecond})
	if want := "With no fault under way (the 35s before the first one), the slowest I/O completion was 1.3s"; !strings.Contains(got, want) {
		t.Errorf("report lacks %q:\n%s", want, got)
	}
	if got := report(1, time.Minute, []string{"v"}, nil, nil, soakTargets, baseline{}); strings.Contains(got, "no fault under way") {
		t.Errorf("a report with no baseline window states one:\n%s", got)
	}
}

// TestHandoverPause: an upgrade's unread spell comes from the daemon
// log's last takeover, and the report states the worst.
func TestHandoverPause(t *testing.T) {
	log := `time=2026-11-27T10:00:00Z level=INFO msg="took over from the previous daemon" devices=8 took=900ms err=<nil> reads_paused_for=1.25s
time=2026-11-27T10:00:01Z level=INFO msg="adopted from the previous daemon" device=/dev/nbd0
time=2026-11-27T10:01:00Z level=INFO msg="took over from the previous daemon" devices=8 took=300ms err=<nil> reads_paused_for=640ms
time=2026-11-27T10:01:01Z level=INFO msg="served" reads_paused_for=9s
`
	if got := lastReadsPaused(log); got != 640*time.Millisecond {
		t.Errorf("last takeover's pause: %s, want 640ms", got)
	}
	if got := lastReadsPaused(`msg="took over from the previous daemon" devices=1 took=1s err=<nil>`); got != 0 {
		t.Errorf("a takeover without the field: %s, want 0", got)
	}
	f := []fault{{kind: fUpgrade, paused: 640 * time.Millisecond}, {kind: fUpgrade, paused: 1250 * time.Millisecond}, {kind: fStop}}
	if got := report(1, time.Minute, []string{"v"}, f, nil, soakTargets, baseline{}); !strings.Contains(got, "went unread for at most 1.25s, 1 of 2 handovers within 1 s") {
		t.Errorf("report lacks the worst handover pause:\n%s", got)
	}
	if got := report(1, time.Minute, []string{"v"}, f[2:], nil, soakTargets, baseline{}); strings.Contains(got, "Handovers:") {
		t.Errorf("a report without upgrades states a handover pause:\n%s", got)
	}
}

// TestSoakKinds: RBD_NBD_GO_SOAK_FAULTS picks kinds by short name, in
// its order; unset, every kind is dealt; an unknown name is an error
// naming the known ones.
func TestSoakKinds(t *testing.T) {
	t.Setenv("RBD_NBD_GO_SOAK_FAULTS", "")
	if all, err := soakKinds(); err != nil || len(all) != 6 {
		t.Fatalf("unset: %v %v", all, err)
	}
	t.Setenv("RBD_NBD_GO_SOAK_FAULTS", "upgrade, osd-cut")
	if got, err := soakKinds(); err != nil || len(got) != 2 || got[0] != fUpgrade || got[1] != fUnreachable {
		t.Fatalf("upgrade, osd-cut: %v %v", got, err)
	}
	t.Setenv("RBD_NBD_GO_SOAK_FAULTS", "upgrade,reboot")
	if _, err := soakKinds(); err == nil || !strings.Contains(err.Error(), "daemon-kill") {
		t.Fatalf("an unknown fault: %v", err)
	}
}
