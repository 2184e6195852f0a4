package daemon

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/attach"
	"github.com/rbd-nbd-go/rbd-nbd-go/control"
	"github.com/rbd-nbd-go/rbd-nbd-go/internal/unixsock"
	"github.com/rbd-nbd-go/rbd-nbd-go/kernel"
)

// fakeKernel takes devices and holds their sockets, as the kernel would,
// without sending I/O: enough for the control protocol.
type fakeKernel struct {
	mu    sync.Mutex
	socks map[int][]*os.File
}

func (k *fakeKernel) Connect(cfg kernel.Config, socks []*os.File) (int, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	i := len(k.socks)
	var dup []*os.File
	for _, f := range socks {
		fd, err := dupFile(f)
		if err != nil {
			return 0, err
		}
		dup = append(dup, fd)
	}
	k.socks[i] = dup
	return i, nil
}

func (k *fakeKernel) Reconfigure(int, kernel.Reconfig, []*os.File) error { return nil }
func (k *fakeKernel) Disconnect(index int) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, f := range k.socks[index] {
		f.Close()
	}
	delete(k.socks, index)
	return nil
}
func (k *fakeKernel) Status(index int) (kernel.Status, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return kernel.Status{Connected: k.socks[index] != nil}, nil
}
func (k *fakeKernel) Name() string { return "fake" }
func (k *fakeKernel) Close() error { return nil }

func TestControlSocket(t *testing.T) {
	dir := t.TempDir()
	store, err := attach.OpenStore(dir)
	if err != nil {
		t.Fatal(err)
	}
	m := attach.NewManager(attach.Config{Kernel: &fakeKernel{socks: map[int][]*os.File{}}, Store: store,
		SysBlock: filepath.Join(dir, "sys"), Dev: filepath.Join(dir, "dev")})
	defer m.Close()
	l, err := unixsock.Listen(control.SocketPath(dir))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// The scheduler widens for map and attach requests only, and hears
	// when each is over.
	var started, over atomic.Int32
	go Serve(ctx, l, m, nil, func() func() { started.Add(1); return func() { over.Add(1) } })
	if fi, _ := os.Stat(control.SocketPath(dir)); fi.Mode().Perm() != 0o600 {
		t.Fatalf("control socket mode %v", fi.Mode())
	}
	c := &control.Client{StateDir: dir}
	if err := c.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	rec := control.Record{Index: control.AnyIndex, Spec: "mem:1M", MapOptions: control.MapOptions{Connections: 1}}
	rec.Ceph.Key = "AQD-secret"
	got, err := c.Map(ctx, rec)
	if err != nil || got.Device() != "/dev/nbd0" || got.Ceph.Key != "" {
		t.Fatalf("map: %+v %v (the key must not leave the daemon)", got, err)
	}
	ls, err := c.List(ctx)
	if err != nil || len(ls.Devices) != 1 || ls.Devices[0].Ceph.Key != "" || ls.PID != os.Getpid() {
		t.Fatalf("list %+v %v", ls, err)
	}
	st, err := c.Status(ctx, "/dev/nbd0", true)
	if err != nil || !st.Served || st.Connections != 1 || st.Live != 1 || st.Size != 1<<20 ||
		st.Used != nil || st.UsedError == "" || st.Record.Ceph.Key != "" {
		t.Fatalf("status %+v %v", st, err)
	}
	if _, err := c.Status(ctx, "/dev/nbd7", false); !errors.Is(err, control.ErrNotMapped) {
		t.Fatalf("status of an unmapped device: %v", err)
	}
	if err := c.Unmap(ctx, "/dev/nbd5"); !errors.Is(err, control.ErrNotMapped) {
		t.Fatalf("unmap of an unmapped device: %v", err)
	}
	if err := c.UnmapCookie(ctx, "/dev/nbd0", "another-volume"); !errors.Is(err, control.ErrNotMapped) {
		t.Fatalf("unmap with another volume's cookie: %v", err)
	}
	if err := c.Unmap(ctx, "/dev/nbd0"); err != nil {
		t.Fatalf("unmap: %v", err)
	}
	resp, _ := c.Call(ctx, control.Request{Op: "explode"}, false)
	if resp.Err() == nil {
		t.Fatal("unknown op accepted")
	}
	// A client that skips the check meets it in the daemon, the only
	// check the manager's records get there.
	for says, o := range map[string]control.MapOptions{
		"connections 99":  {Connections: 99},
		"block size 3000": {Connections: 1, BlockSize: 3000},
	} {
		bad := control.Record{Index: control.AnyIndex, Spec: "mem:1M", MapOptions: o}
		resp, _ = c.Call(ctx, control.Request{Op: control.OpMap, Record: &bad}, false)
		if err := resp.Err(); err == nil || !strings.Contains(err.Error(), says) {
			t.Fatalf("daemon accepted a bad record (%s): %v", says, err)
		}
	}
	if ls, _ := c.List(ctx); len(ls.Devices) != 0 {
		t.Fatalf("bad records mapped: %+v", ls.Devices)
	}
	for i := 0; i < 200 && over.Load() < 3; i++ { // done runs after the response is sent
		time.Sleep(10 * time.Millisecond)
	}
	if started.Load() != 3 || over.Load() != 3 {
		t.Fatalf("serving hook: %d started and %d over, want 3 each (the three map requests)", started.Load(), over.Load())
	}
}
