package attach

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/control"
	"github.com/rbd-nbd-go/rbd-nbd-go/kernel"
)

// mapTwo maps two file-backed devices of two connections each, with a
// block of data written through the kernel's first socket of each.
func mapTwo(t *testing.T, r *rig, m *Manager) ([]control.Record, []byte) {
	data := bytes.Repeat([]byte("handover"), 512)
	var recs []control.Record
	for i, name := range []string{"a.img", "b.img"} {
		rec, err := m.Map(control.Record{Index: kernel.AnyIndex, Spec: r.fileNamed(t, name, 4<<20),
			Cookie: "vol-" + name, MapOptions: control.MapOptions{Connections: 2}})
		if err != nil {
			t.Fatal(err)
		}
		if e, _ := kio(t, r.k.dev(t, rec.Index).socks[0], cmdWrite, uint64(i)*4096, 4096, data); e != 0 {
			t.Fatal(e)
		}
		recs = append(recs, rec)
	}
	return recs, data
}

// handOver pauses m for a handover, failing the test if it cannot.
func handOver(t *testing.T, m *Manager) *Handover {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ho, err := m.HandOver(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return ho
}

// readReply reads one simple reply's header and returns its handle.
func readReply(t *testing.T, sock *os.File) (handle uint64, errno uint32) {
	t.Helper()
	var r [16]byte
	sock.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(sock, r[:]); err != nil {
		t.Fatalf("reply: %v", err)
	}
	return binary.BigEndian.Uint64(r[8:]), binary.BigEndian.Uint32(r[4:])
}

// TestHandOverRequestSplitAcrossIt: a WRITE whose payload is half sent
// when the handover starts is read whole and answered by the old
// daemon; the new one serves the same kernel sockets on, with no
// RECONFIGURE, and every write is there.
func TestHandOverRequestSplitAcrossIt(t *testing.T) {
	r := newRig(t)
	m1 := NewManager(Config{Kernel: r.k, Store: r.store, SysBlock: r.sys, Dev: r.dir})
	recs, data := mapTwo(t, r, m1)
	sock := r.k.dev(t, recs[0].Index).socks[1]

	// The new daemon opens the images ahead, while the old one serves:
	// one as listed, one listed under another cookie (as if unmapped and
	// mapped again in between), which Adopt must not use.
	m2 := r.manager(t)
	listed := m1.List()
	listed[1].Cookie += "-earlier"
	prep := m2.Prepare(listed)
	if len(prep.devs) != 2 {
		t.Fatalf("prepared %d of 2", len(prep.devs))
	}
	split := bytes.Repeat([]byte("split!!!"), 512)
	var h [28]byte
	binary.BigEndian.PutUint32(h[0:], 0x25609513)
	binary.BigEndian.PutUint16(h[6:], cmdWrite)
	binary.BigEndian.PutUint64(h[8:], 99)
	binary.BigEndian.PutUint64(h[16:], 65536)
	binary.BigEndian.PutUint32(h[24:], 4096)
	if _, err := sock.Write(append(h[:], split[:1000]...)); err != nil {
		t.Fatal(err)
	}
	paused := make(chan *Handover, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		h, err := m1.HandOver(ctx)
		if err != nil {
			t.Error(err)
		}
		paused <- h
	}()
	select {
	case <-paused:
		t.Fatal("the pause ended with a request half read")
	case <-time.After(200 * time.Millisecond):
	}
	if _, err := sock.Write(split[1000:]); err != nil {
		t.Fatal(err)
	}
	ho := <-paused
	if ho == nil {
		t.FailNow()
	}
	if handle, e := readReply(t, sock); handle != 99 || e != 0 {
		t.Fatalf("split write: reply %d errno %d", handle, e)
	}
	handed, err := ho.Release()
	if err != nil {
		t.Fatal(err)
	}
	if len(m1.List()) != 0 || len(handed) != 2 || len(handed[0].Conns) != 2 || len(handed[1].Conns) != 2 {
		t.Fatalf("old manager lists %v; handed %+v", m1.List(), handed)
	}
	if err := m2.Adopt(handed, prep); err != nil {
		t.Fatal(err)
	}
	if len(prep.devs) != 0 {
		t.Fatalf("Adopt left %d prepared backends open", len(prep.devs))
	}
	for i, rec := range recs {
		for j, s := range r.k.dev(t, rec.Index).socks {
			if e, got := kio(t, s, cmdRead, uint64(i)*4096, 4096, nil); e != 0 || !bytes.Equal(got, data) {
				t.Fatalf("device %d socket %d after the handover: errno %d", i, j, e)
			}
		}
	}
	if e, got := kio(t, sock, cmdRead, 65536, 4096, nil); e != 0 || !bytes.Equal(got, split) {
		t.Fatalf("the split write after the handover: errno %d", e)
	}
	if len(r.k.reconfigs) != 0 || len(m2.List()) != 2 {
		t.Fatalf("reconfigures %+v; new manager lists %v", r.k.reconfigs, m2.List())
	}
	// The new manager owns them fully: unmap works.
	if err := m2.Unmap(recs[1].Device()); err != nil {
		t.Fatal(err)
	}
}

// TestHandOverRefusedHalfway: the new daemon gives up after the pause;
// the old one reads on from where it stopped.
func TestHandOverRefusedHalfway(t *testing.T) {
	r := newRig(t)
	m1 := r.manager(t)
	recs, data := mapTwo(t, r, m1)
	ho := handOver(t, m1)
	// A request sent while paused waits in the socket.
	sock := r.k.dev(t, recs[1].Index).socks[0]
	if err := writeReq(sock, cmdRead, 5, 4096, 4096, nil); err != nil {
		t.Fatal(err)
	}
	ho.Abort()
	if handle, e := readReply(t, sock); handle != 5 || e != 0 {
		t.Fatalf("reply %d errno %d", handle, e)
	}
	got := make([]byte, 4096)
	if _, err := io.ReadFull(sock, got); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read after an aborted handover: %v", err)
	}
	if _, err := ho.Release(); err == nil {
		t.Fatal("release after abort")
	}
	if len(m1.List()) != 2 {
		t.Fatalf("lists %v", m1.List())
	}
	if err := m1.Unmap(recs[0].Device()); err != nil {
		t.Fatal(err)
	}
}

// TestAdoptFailureFallsBackToReattach: a device whose backend does not
// open in the new daemon has its sockets closed; the kernel sees them
// die and the ordinary reattach serves it.
func TestAdoptFailureFallsBackToReattach(t *testing.T) {
	r := newRig(t)
	m1 := NewManager(Config{Kernel: r.k, Store: r.store, SysBlock: r.sys, Dev: r.dir})
	recs, data := mapTwo(t, r, m1)
	ho := handOver(t, m1)
	handed, err := ho.Release()
	if err != nil {
		t.Fatal(err)
	}
	img := strings.TrimPrefix(recs[0].Spec, "file:")
	os.Rename(img, img+".away")
	m2 := r.manager(t)
	if err := m2.Adopt(handed, nil); err == nil || !strings.Contains(err.Error(), recs[0].Device()) {
		t.Fatalf("adopt with a missing backend: %v", err)
	}
	os.Rename(img+".away", img)
	if err := m2.Restore(); err != nil {
		t.Fatal(err)
	}
	for _, s := range r.k.dev(t, recs[0].Index).socks {
		if e, got := kio(t, s, cmdRead, 0, 4096, nil); e != 0 || !bytes.Equal(got, data) {
			t.Fatalf("after the fallback reattach: errno %d", e)
		}
	}
	if len(r.k.reconfigs) == 0 {
		t.Fatal("no RECONFIGURE: the failed device was not reattached")
	}
}
