package attach

import (
	"io"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// deadWithUnreadReply maps a two-connection device and plays the kernel
// timing out socket 1 while a 4 KiB READ reply still sits unread on it:
// it shuts its end down, as nbd_xmit_timeout does, leaving the reply
// for its receive worker.
func deadWithUnreadReply(t *testing.T) (*Manager, *fakeDev, int) {
	t.Helper()
	r := newRig(t)
	m := r.manager(t)
	rec := mapMemTwo(t, m)
	d := r.k.dev(t, rec.Index)
	sock := d.socks[1]
	if err := writeReq(sock, cmdRead, 7, 0, 4096, nil); err != nil {
		t.Fatal(err)
	}
	for i := 0; ; i++ {
		if n, _ := unix.IoctlGetInt(int(sock.Fd()), unix.SIOCINQ); n == 16+4096 {
			break
		}
		if i == 500 {
			t.Fatal("the READ's reply never arrived")
		}
		time.Sleep(2 * time.Millisecond)
	}
	unix.Shutdown(int(sock.Fd()), unix.SHUT_RDWR)
	return m, d, rec.Index
}

// TestReplaceDeadWaitsForTheOldReader: no new socket goes in while the
// kernel still has replies to read on the dead one (see settle.go); once
// it has read them, the replacement follows within the grace.
func TestReplaceDeadWaitsForTheOldReader(t *testing.T) {
	m, d, index := deadWithUnreadReply(t)
	old := d.socks[1]
	done := make(chan struct{})
	go func() {
		m.ReplaceDead(index)
		close(done)
	}()
	select {
	case <-done:
		t.Fatal("ReplaceDead went ahead with a reply unread on the dead socket")
	case <-time.After(300 * time.Millisecond):
	}
	// The old worker reads its last reply.
	if _, err := io.ReadFull(old, make([]byte, 16+4096)); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	select {
	case <-done:
	case <-time.After(settleMax):
		t.Fatal("ReplaceDead still waits after the dead socket was read empty")
	}
	if took := time.Since(t0); took < settleGrace {
		t.Errorf("replaced %s after the last read, before the grace of %s", took, settleGrace)
	}
	if d.socks[1] == old {
		t.Fatal("dead socket not replaced")
	}
	if e, _ := kio(t, d.socks[1], cmdFlush, 0, 0, nil); e != 0 {
		t.Fatalf("flush on the new connection: %d", e)
	}
}

// TestSettleDeadIsBounded: a kernel that never reads what is left (its
// worker gone another way) holds the replacement up for max, no longer;
// a device with no dead socket is not held at all.
func TestSettleDeadIsBounded(t *testing.T) {
	m, _, index := deadWithUnreadReply(t)
	s := m.get(index).s
	t0 := time.Now()
	waited, drained := s.settleDead(200*time.Millisecond, 10*time.Millisecond)
	if drained || waited < 200*time.Millisecond || time.Since(t0) > 2*time.Second {
		t.Fatalf("settleDead: waited %s, drained %v; want about 210ms, false", waited, drained)
	}

	r := newRig(t)
	m2 := r.manager(t)
	rec := mapMemTwo(t, m2)
	if waited, drained := m2.get(rec.Index).s.settleDead(time.Second, time.Second); waited != 0 || !drained {
		t.Fatalf("settleDead with every connection live: waited %s, drained %v", waited, drained)
	}
}
