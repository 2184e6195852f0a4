package rbdio

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
	"github.com/rbd-nbd-go/rbd-nbd-go/internal/cephtest"
	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
)

var cluster *cephtest.Cluster

func TestMain(m *testing.M) {
	var err error
	if cluster, err = cephtest.Start(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := m.Run()
	if cluster != nil {
		cluster.Stop()
	}
	os.Exit(code)
}

func needCluster(t testing.TB) *cephtest.Cluster {
	t.Helper()
	if cluster == nil {
		t.Skip("Ceph not installed")
	}
	return cluster
}

var imageSeq int

// newImage creates a fresh image and returns its spec.
func newImage(t testing.TB, size string) ceph.ImageSpec {
	c := needCluster(t)
	imageSeq++
	name := fmt.Sprintf("t%d-%d", os.Getpid(), imageSeq)
	if _, err := c.Rbd("create", "--size", size, "rbd/"+name); err != nil {
		t.Fatal(err)
	}
	return ceph.ImageSpec{Pool: "rbd", Image: name}
}

func opts() ceph.Options { return ceph.Options{Conf: cluster.Conf, OpTimeout: 20 * time.Second} }

func open(t testing.TB, cl *Clusters, spec ceph.ImageSpec, oo OpenOptions) *Image {
	t.Helper()
	im, err := Open(cl, opts(), spec, oo)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { im.Close() })
	return im
}

func do(t testing.TB, im *Image, op nbd.Op, flags nbd.ReqFlags, off uint64, data []byte, length int) error {
	t.Helper()
	r := &nbd.Request{Op: op, Flags: flags, Offset: off, Length: uint32(length), Data: data}
	return nbd.Do(im, r)
}

// export reads the image back with the rbd tool: the ground truth.
func export(t testing.TB, spec ceph.ImageSpec) []byte {
	t.Helper()
	p := filepath.Join(t.TempDir(), "export")
	if _, err := cluster.Rbd("export", spec.String(), p); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func usedBytes(t testing.TB, spec ceph.ImageSpec) string {
	out, err := cluster.Rbd("du", "--format", "json", spec.String())
	if err != nil {
		t.Fatal(err)
	}
	i := strings.Index(out, `"used_size":`)
	if i < 0 {
		t.Fatalf("rbd du: %s", out)
	}
	return strings.SplitN(out[i+len(`"used_size":`):], ",", 2)[0]
}

func TestImageReadWriteTrimZeroes(t *testing.T) {
	spec := newImage(t, "64M")
	im := open(t, NewClusters(), spec, OpenOptions{})
	if im.Size() != 64<<20 {
		t.Fatalf("size %d", im.Size())
	}
	want := make([]byte, 16<<20)
	for i := range want {
		want[i] = byte(i*31 + i>>12)
	}
	if err := do(t, im, nbd.OpWrite, 0, 0, want[:8<<20], 8<<20); err != nil {
		t.Fatal(err)
	}
	if err := do(t, im, nbd.OpWrite, nbd.ReqFUA, 8<<20, want[8<<20:], 8<<20); err != nil {
		t.Fatal(err)
	}
	if err := do(t, im, nbd.OpFlush, 0, 0, nil, 0); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 16<<20)
	if err := do(t, im, nbd.OpRead, 0, 0, got, len(got)); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("read back: %v", err)
	}
	if !bytes.Equal(export(t, spec)[:16<<20], want) {
		t.Fatal("rbd export differs from what was written")
	}
	used := usedBytes(t, spec)
	// Trim the first 8 MiB (two whole 4 MiB objects): deallocated.
	if err := do(t, im, nbd.OpTrim, 0, 0, nil, 8<<20); err != nil {
		t.Fatal(err)
	}
	// Zero 1 MiB inside the second half, keeping it allocated.
	if err := do(t, im, nbd.OpWriteZeroes, nbd.ReqNoHole, 9<<20, nil, 1<<20); err != nil {
		t.Fatal(err)
	}
	clear(want[:8<<20])
	clear(want[9<<20 : 10<<20])
	if !bytes.Equal(export(t, spec)[:16<<20], want) {
		t.Fatal("trim/zeroes: rbd export does not read zeroes where expected")
	}
	if after := usedBytes(t, spec); after == used {
		t.Fatalf("rbd du still %s after trimming 8 MiB", after)
	}
}

func TestReadOnlyAndSnapshot(t *testing.T) {
	spec := newImage(t, "8M")
	cl := NewClusters()
	rw := open(t, cl, spec, OpenOptions{})
	if err := do(t, rw, nbd.OpWrite, 0, 0, bytes.Repeat([]byte{7}, 4096), 4096); err != nil {
		t.Fatal(err)
	}
	if _, err := cluster.Rbd("snap", "create", spec.String()+"@s1"); err != nil {
		t.Fatal(err)
	}
	snap := spec
	snap.Snap = "s1"
	for _, c := range []struct {
		spec ceph.ImageSpec
		ro   bool
	}{{spec, true}, {snap, false}} {
		im := open(t, cl, c.spec, OpenOptions{ReadOnly: c.ro})
		if im.Caps()&nbd.CapReadOnly == 0 {
			t.Fatalf("%v: not read-only", c.spec)
		}
		err := do(t, im, nbd.OpWrite, 0, 0, make([]byte, 4096), 4096)
		if nbd.ErrnoOf(err) != nbd.ErrPerm {
			t.Fatalf("%v: write gave %v, want EPERM", c.spec, err)
		}
		got := make([]byte, 4096)
		if err := do(t, im, nbd.OpRead, 0, 0, got, 4096); err != nil || got[0] != 7 {
			t.Fatalf("%v: read %v %d", c.spec, err, got[0])
		}
	}
}

func TestExclusiveLock(t *testing.T) {
	spec := newImage(t, "8M")
	open(t, NewClusters(), spec, OpenOptions{Exclusive: true})
	_, err := Open(NewClusters(), opts(), spec, OpenOptions{Exclusive: true})
	if err == nil || !strings.Contains(err.Error(), "held by another client") {
		t.Fatalf("second exclusive open: %v", err)
	}
}

func TestResizeIsSeen(t *testing.T) {
	spec := newImage(t, "8M")
	resized := make(chan uint64, 4)
	im := open(t, NewClusters(), spec, OpenOptions{OnResize: func(s uint64) { resized <- s }})
	if _, err := cluster.Rbd("resize", "--size", "24M", spec.String()); err != nil {
		t.Fatal(err)
	}
	select {
	case s := <-resized:
		if s != 24<<20 || im.Size() != 24<<20 {
			t.Fatalf("resized to %d, Size %d", s, im.Size())
		}
	case <-time.After(15 * time.Second):
		t.Fatal("resize not noticed within 15s")
	}
	// The new end is usable at once.
	if err := do(t, im, nbd.OpWrite, 0, 20<<20, make([]byte, 4096), 4096); err != nil {
		t.Fatal(err)
	}
}

func TestOpenErrors(t *testing.T) {
	needCluster(t)
	spec := newImage(t, "8M")
	badKeyring := filepath.Join(t.TempDir(), "keyring")
	os.WriteFile(badKeyring, []byte("[client.admin]\n\tkey = AQBvaBFZAAAAABAAAAAAAAAAAAAAAAAAAAAAAA==\n"), 0o600)
	cases := []struct {
		name string
		o    ceph.Options
		spec ceph.ImageSpec
		want string
	}{
		{"missing pool", opts(), ceph.ImageSpec{Pool: "nopool", Image: "x"}, `pool "nopool" does not exist`},
		{"missing image", opts(), ceph.ImageSpec{Pool: "rbd", Image: "nope"}, "image rbd/nope does not exist"},
		{"missing snapshot", opts(), ceph.ImageSpec{Pool: "rbd", Image: spec.Image, Snap: "nosnap"}, "does not exist"},
		{"wrong key", ceph.Options{Conf: cluster.Conf, Keyring: badKeyring, OpTimeout: 5 * time.Second}, spec, "permission denied"},
		{"unreachable monitor", ceph.Options{MonHost: "127.0.0.1:1", Keyring: badKeyring, OpTimeout: 3 * time.Second}, spec, "no monitor answered"},
	}
	for _, c := range cases {
		start := time.Now()
		_, err := Open(NewClusters(), c.o, c.spec, OpenOptions{})
		if err == nil || !strings.Contains(err.Error(), c.want) || strings.Contains(err.Error(), "\n") {
			t.Errorf("%s: %v, want one line containing %q", c.name, err, c.want)
		}
		if d := time.Since(start); d > 30*time.Second {
			t.Errorf("%s: took %v", c.name, d)
		}
		if strings.Contains(fmt.Sprint(err), "AQBvaBFZ") {
			t.Errorf("%s: error leaks the key", c.name)
		}
	}
}

// TestNoGoroutinePerRequest: hundreds of requests in flight do not
// create goroutines or threads per request.
func TestNoGoroutinePerRequest(t *testing.T) {
	spec := newImage(t, "64M")
	im := open(t, NewClusters(), spec, OpenOptions{})
	const n = 256
	var wg sync.WaitGroup
	started := make(chan struct{})
	var peak int
	var mu sync.Mutex
	base := runtime.NumGoroutine()
	reqs := make([]*nbd.Request, n)
	done := make(chan struct{}, n)
	for i := range reqs {
		reqs[i] = &nbd.Request{Op: nbd.OpWrite, Offset: uint64(i) * 65536, Length: 65536, Data: make([]byte, 65536)}
	}
	wg.Add(1)
	go func() { // sample while requests are in flight
		defer wg.Done()
		<-started
		for range 50 {
			mu.Lock()
			peak = max(peak, runtime.NumGoroutine())
			mu.Unlock()
			time.Sleep(time.Millisecond)
		}
	}()
	for _, r := range reqs {
		submitAsync(im, r, done)
	}
	close(started)
	for range n {
		<-done
	}
	wg.Wait()
	if extra := peak - base; extra > 8 {
		t.Fatalf("%d goroutines beyond the baseline with %d requests in flight", extra, n)
	}
}

func submitAsync(im *Image, r *nbd.Request, done chan<- struct{}) {
	nbd.Go(im, r, func(*nbd.Request) { done <- struct{}{} })
}

// BenchmarkAio4K: the librbd path allocates nothing per request in Go
// (run with -benchmem). QD32 random 4 KiB, read or write.
func BenchmarkAio4KRead(b *testing.B)  { benchAio(b, nbd.OpRead) }
func BenchmarkAio4KWrite(b *testing.B) { benchAio(b, nbd.OpWrite) }

func benchAio(b *testing.B, op nbd.Op) {
	spec := newImage(b, "256M")
	im := open(b, NewClusters(), spec, OpenOptions{})
	const depth = 32
	done := make(chan *nbd.Request, depth)
	cb := func(r *nbd.Request) { done <- r }
	reqs := make([]nbd.Request, depth)
	for i := range reqs {
		reqs[i] = nbd.Request{Op: op, Length: 4096, Data: make([]byte, 4096)}
	}
	next := uint64(0)
	issue := func(r *nbd.Request) {
		next = next*6364136223846793005 + 1442695040888963407
		r.Offset = (next >> 20) % (256 << 20 / 4096) * 4096
		nbd.Go(im, r, cb)
	}
	for i := range reqs {
		issue(&reqs[i])
	}
	for range 1000 { // warm up slots, pinners and librbd
		issue(<-done)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		r := <-done
		if r.Err() != nil {
			b.Fatal(r.Err())
		}
		issue(r)
	}
	b.StopTimer()
	for range depth {
		<-done
	}
}

// TestIOBeyondShrunkEnd: a connection may still address space that an
// `rbd resize --allow-shrink` took away. Such I/O must complete (with an
// error or a short result), never hang.
func TestIOBeyondShrunkEnd(t *testing.T) {
	spec := newImage(t, "16M")
	im := open(t, NewClusters(), spec, OpenOptions{})
	if _, err := cluster.Rbd("resize", "--allow-shrink", "--size", "4M", spec.String()); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(15 * time.Second); im.Size() != 4<<20; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("shrink not noticed")
		}
	}
	for _, op := range []nbd.Op{nbd.OpRead, nbd.OpWrite, nbd.OpTrim} {
		r := &nbd.Request{Op: op, Offset: 8 << 20, Length: 4096}
		if op != nbd.OpTrim {
			r.Data = make([]byte, 4096)
		}
		done := make(chan struct{})
		nbd.Go(im, r, func(*nbd.Request) { close(done) })
		select {
		case <-done:
			if r.Err() == nil {
				t.Fatalf("%v beyond the end succeeded", op)
			}
		case <-time.After(20 * time.Second):
			t.Fatalf("%v beyond the end of a shrunk image never completed", op)
		}
	}
}

func TestBlockStatus(t *testing.T) {
	spec := newImage(t, "16M") // 4 MiB objects, fast-diff by default
	im := open(t, NewClusters(), spec, OpenOptions{})
	if im.Caps()&nbd.CapBlockStatus == 0 {
		t.Fatal("block status not offered on a fast-diff image")
	}
	for _, off := range []uint64{0, 9 << 20} {
		if err := do(t, im, nbd.OpWrite, 0, off, make([]byte, 4096), 4096); err != nil {
			t.Fatal(err)
		}
	}
	r := &nbd.Request{Op: nbd.OpBlockStatus, Length: 16 << 20}
	if err := nbd.Do(im, r); err != nil {
		t.Fatal(err)
	}
	hz := uint32(nbd.StateHole | nbd.StateZero)
	want := []nbd.Extent{{Length: 4 << 20}, {Length: 4 << 20, Flags: hz}, {Length: 4 << 20}, {Length: 4 << 20, Flags: hz}}
	if fmt.Sprint(r.Extents) != fmt.Sprint(want) {
		t.Fatalf("extents %v, want %v", r.Extents, want)
	}
}

// Several images on one Clusters share one RADOS connection.
func TestConnectionShared(t *testing.T) {
	cl := NewClusters()
	open(t, cl, newImage(t, "4M"), OpenOptions{})
	open(t, cl, newImage(t, "4M"), OpenOptions{})
	cl.mu.Lock()
	defer cl.mu.Unlock()
	if len(cl.conns) != 1 {
		t.Fatalf("%d connections for one identity", len(cl.conns))
	}
	for _, ref := range cl.conns {
		if ref.refs != 2 {
			t.Fatalf("refs %d", ref.refs)
		}
	}
}

// A connect that hangs until the monitor timeout (here: no monitor
// listens) does not hold up connects for other identities: the
// provisioner retrying a wrong key must not stall every other volume.
func TestSlowConnectBlocksOnlyItself(t *testing.T) {
	spec := newImage(t, "8M")
	cl := NewClusters()
	dead := ceph.Options{MonHost: "127.0.0.1:1", OpTimeout: 10 * time.Second}
	deadDone := make(chan error, 1)
	go func() {
		_, err := Open(cl, dead, spec, OpenOptions{})
		deadDone <- err
	}()
	time.Sleep(500 * time.Millisecond) // its connect is under way
	start := time.Now()
	im, err := Open(cl, opts(), spec, OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	im.Close()
	took := time.Since(start)
	select {
	case err := <-deadDone:
		t.Fatalf("the live open waited for the dead monitor's connect to end (%v)", err)
	default:
	}
	if took > 8*time.Second {
		t.Errorf("open on the live cluster took %v behind a hanging connect", took)
	}
	if err := <-deadDone; err == nil {
		t.Error("open with no monitor succeeded")
	}
}

// TestDeferredOpenActivates: a Deferred exclusive open succeeds while
// another client holds the lock (a daemon opening images ahead of a
// handover), takes no lock, and Activate takes it once it is free.
func TestDeferredOpenActivates(t *testing.T) {
	spec := newImage(t, "8M")
	holder, err := Open(NewClusters(), opts(), spec, OpenOptions{Exclusive: true})
	if err != nil {
		t.Fatal(err)
	}
	im := open(t, NewClusters(), spec, OpenOptions{Exclusive: true, Deferred: true})
	if err := im.Activate(); err == nil || !strings.Contains(err.Error(), "held by another client") {
		t.Fatalf("Activate while the lock is held: %v", err)
	}
	// The holder still writes: the deferred open took nothing from it.
	if err := do(t, holder, nbd.OpWrite, 0, 0, make([]byte, 4096), 4096); err != nil {
		t.Fatalf("the holder's write: %v", err)
	}
	if err := holder.Close(); err != nil {
		t.Fatal(err)
	}
	if err := im.Activate(); err != nil {
		t.Fatalf("Activate once free: %v", err)
	}
	if err := do(t, im, nbd.OpWrite, 0, 4096, make([]byte, 4096), 4096); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(NewClusters(), opts(), spec, OpenOptions{Exclusive: true}); err == nil {
		t.Fatal("an exclusive open succeeded beside the activated image")
	}
}

// TestConnectionsCountImages: the shared connection counts the images
// open on it, names no secret, and is gone with the last image.
func TestConnectionsCountImages(t *testing.T) {
	a, b := newImage(t, "4M"), newImage(t, "4M")
	c := NewClusters()
	ia, err := Open(c, opts(), a, OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ib, err := Open(c, opts(), b, OpenOptions{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Open(c, opts(), ceph.ImageSpec{Pool: a.Pool, Image: "no-such-image"}, OpenOptions{}); err == nil {
		t.Fatal("opened a missing image")
	}
	cs := c.Connections()
	if len(cs) != 1 || cs[0].Images != 2 || cs[0].User == "" || cs[0].Cluster == "" {
		t.Fatalf("connections %+v, want one with 2 images", cs)
	}
	if k := opts().Key; k != "" && (strings.Contains(cs[0].Cluster, k) || strings.Contains(cs[0].User, k)) {
		t.Fatal("a connection is named by its key")
	}
	ia.Close()
	if cs := c.Connections(); len(cs) != 1 || cs[0].Images != 1 {
		t.Fatalf("after one close: %+v", cs)
	}
	ib.Close()
	if cs := c.Connections(); len(cs) != 0 {
		t.Fatalf("after the last close: %+v", cs)
	}
}
