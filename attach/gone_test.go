package attach

import (
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rbd-nbd-go/rbd-nbd-go/control"
	"github.com/rbd-nbd-go/rbd-nbd-go/kernel"
)

// released waits (bounded) until m no longer lists the device and the
// store has no record of it.
func released(m *Manager, st *Store, within time.Duration) bool {
	for deadline := time.Now().Add(within); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if recs, _ := st.Load(); len(recs) == 0 && len(m.List()) == 0 {
			return true
		}
	}
	return false
}

func killSockets(d *fakeDev) {
	for _, s := range d.socks {
		unix.Shutdown(int(s.Fd()), unix.SHUT_RDWR)
	}
}

func TestDeviceDisconnectedElsewhereIsReleased(t *testing.T) {
	r := newRig(t)
	m := r.manager(t)
	rec, err := m.Map(control.Record{Index: kernel.AnyIndex, Spec: r.file(t, 1<<20), Cookie: "mine",
		MapOptions: control.MapOptions{Connections: 2}})
	if err != nil {
		t.Fatal(err)
	}
	d := r.k.dev(t, rec.Index)
	// Every connection times out: the kernel keeps the device and waits
	// for new sockets, so the device must stay.
	killSockets(d)
	if released(m, r.store, time.Second) {
		t.Fatal("released a device the kernel still has")
	}
	m.ReplaceDead(rec.Index)
	m.ReplaceDead(rec.Index)
	if e, _ := kio(t, d.socks[1], cmdFlush, 0, 0, nil); e != 0 {
		t.Fatalf("flush on a replaced connection: %d", e)
	}
	// Another tool disconnects it.
	if err := r.k.Disconnect(rec.Index); err != nil {
		t.Fatal(err)
	}
	if !released(m, r.store, 10*time.Second) {
		t.Fatalf("still mapped after the kernel dropped it: %v", m.List())
	}
	// The index is free for a new map.
	if _, err := m.Map(control.Record{Index: rec.Index, Spec: "mem:1M", Cookie: "next"}); err != nil {
		t.Fatalf("map again: %v", err)
	}
}

func TestDeviceTakenOverIsReleased(t *testing.T) {
	r := newRig(t)
	m := r.manager(t)
	rec, err := m.Map(control.Record{Index: kernel.AnyIndex, Spec: "mem:1M", Cookie: "mine"})
	if err != nil {
		t.Fatal(err)
	}
	backend := filepath.Join(r.sys, "nbd"+strconv.Itoa(rec.Index), "backend")
	os.WriteFile(backend, []byte("mine\n"), 0o644)
	killSockets(r.k.dev(t, rec.Index))
	if released(m, r.store, 700*time.Millisecond) {
		t.Fatal("released a device still ours in the kernel")
	}
	// The kernel gave up on us and someone else connected the index.
	os.WriteFile(backend, []byte("theirs\n"), 0o644)
	if !released(m, r.store, 10*time.Second) {
		t.Fatalf("still holding a device now someone else's: %v", m.List())
	}
}
