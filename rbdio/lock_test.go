package rbdio

import (
	"errors"
	"testing"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
)

// TestReleaseLockHandsOver is a handover on one image: the old open
// releases its lock and stays open; the new (Deferred) open takes the
// lock at once and writes, while the old refuses writes and flushes and
// leaves snapshots' quiesces to the new one's hook; then the old closes
// without taking anything back.
func TestReleaseLockHandsOver(t *testing.T) {
	spec := newImage(t, "8M")
	oldHook, newHook := &quiesceRecorder{}, &quiesceRecorder{}
	old, err := Open(NewClusters(), opts(), spec, OpenOptions{Exclusive: true, OnQuiesce: oldHook.hook})
	if err != nil {
		t.Fatal(err)
	}
	defer old.Close()
	// The new daemon's open ahead: its hook stays off until Activate.
	im := open(t, NewClusters(), spec, OpenOptions{Exclusive: true, Deferred: true, OnQuiesce: newHook.hook})
	if out, err := cluster.Rbd("snap", "create", spec.String()+"@before"); err != nil {
		t.Fatalf("snap create: %v %s", err, out)
	}
	if o, n := oldHook.calls(), newHook.calls(); len(o) != 2 || len(n) != 0 {
		t.Fatalf("before the handover: old hook %v, new hook %v; want [true false] and none", o, n)
	}
	if err := do(t, old, nbd.OpWrite, 0, 0, make([]byte, 4096), 4096); err != nil {
		t.Fatalf("the holder's write: %v", err)
	}
	t0 := time.Now()
	if err := old.ReleaseLock(); err != nil {
		t.Fatal(err)
	}
	released := time.Since(t0)
	for _, op := range []nbd.Op{nbd.OpWrite, nbd.OpFlush} {
		var data []byte
		if op == nbd.OpWrite {
			data = make([]byte, 4096)
		}
		if err := do(t, old, op, 0, 0, data, len(data)); !errors.Is(err, nbd.ErrShutdown) {
			t.Fatalf("%v after the release: %v, want %v", op, err, nbd.ErrShutdown)
		}
	}
	if err := do(t, old, nbd.OpRead, 0, 0, make([]byte, 4096), 4096); err != nil {
		t.Fatalf("a read after the release: %v", err)
	}
	if err := im.Activate(); err != nil {
		t.Fatalf("Activate after the release: %v", err)
	}
	if err := do(t, im, nbd.OpWrite, 0, 4096, make([]byte, 4096), 4096); err != nil {
		t.Fatal(err)
	}
	if out, err := cluster.Rbd("snap", "create", spec.String()+"@after"); err != nil {
		t.Fatalf("snap create: %v %s", err, out)
	}
	if o, n := oldHook.calls(), newHook.calls(); len(o) != 2 || len(n) != 2 || !n[0] || n[1] {
		t.Fatalf("after the handover: old hook %v, new hook %v; want the new one's [true false] only", o, n)
	}
	t0 = time.Now()
	if err := old.Close(); err != nil {
		t.Fatal(err)
	}
	t.Logf("release %s, the rest of the close %s", released, time.Since(t0))
	// The new open kept the lock through the old one's close.
	if _, err := Open(NewClusters(), opts(), spec, OpenOptions{Exclusive: true}); err == nil {
		t.Fatal("an exclusive open succeeded beside the new owner")
	}
	if err := do(t, im, nbd.OpWrite, 0, 8192, make([]byte, 4096), 4096); err != nil {
		t.Fatal(err)
	}
}
