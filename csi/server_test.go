package csi

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
)

// panicImages panics in ImageInfo, as a bug would.
type panicImages struct{ *fakeImages }

func (panicImages) ImageInfo(o ceph.Options, spec ceph.ImageSpec) (ceph.ImageInfo, error) {
	panic("boom")
}

// callLog is a CallObserver that keeps what it heard.
type callLog struct {
	mu    sync.Mutex
	calls []string
}

func (c *callLog) ObserveCall(method, code string, took time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.calls = append(c.calls, method+" "+code)
}

// serveRig serves r's driver on a unix socket in its directory until
// the test ends, and dials it.
func serveRig(t *testing.T, r *rig) (context.Context, string, *grpc.ClientConn) {
	t.Helper()
	sock := filepath.Join(r.dir, "csi.sock")
	l, err := Listen("unix://"+sock, false)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go r.d.Serve(ctx, l)
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return ctx, sock, conn
}

func TestServerInterceptors(t *testing.T) {
	calls := &callLog{}
	r := newRigWith(t, func(c *Config) { c.Calls = calls })
	ctx, sock, conn := serveRig(t, r)
	if fi, err := os.Stat(sock); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("endpoint mode %v %v, want 0600", fi.Mode(), err)
	}
	if l2, err := Listen("unix://"+sock, false); err == nil {
		l2.Close()
		t.Fatal("a second plugin took a live endpoint")
	}
	cc := csi.NewControllerClient(conn)
	req := &csi.CreateVolumeRequest{Name: "pvc-g", Parameters: map[string]string{"clusterID": "c1"},
		VolumeCapabilities: []*csi.VolumeCapability{mountCap("ext4", rwo)},
		Secrets:            map[string]string{"userID": "csi", "userKey": "AQDkey"}}
	if _, err := cc.CreateVolume(ctx, req); err != nil {
		t.Fatal(err)
	}
	req.Secrets["userKey"] = "AQDwrongkey"
	_, err := cc.CreateVolume(ctx, req)
	wantCode(t, "wrong key", err, codes.PermissionDenied)
	logs := r.logs.String()
	if strings.Contains(logs, "AQD") || !strings.Contains(logs, "***stripped***") {
		t.Fatalf("secrets not stripped from the log:\n%s", logs)
	}
	if !strings.Contains(logs, "req=1 ") || !strings.Contains(logs, "req=2 ") {
		t.Fatalf("no request IDs in the log:\n%s", logs)
	}
	r.d.cfg.Images = panicImages{r.images}
	_, err = cc.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "pvc-h", Parameters: map[string]string{"clusterID": "c1"},
		VolumeCapabilities: []*csi.VolumeCapability{mountCap("ext4", rwo)}, Secrets: goodSecrets})
	wantCode(t, "panic", err, codes.Internal, "boom")
	// The server is still up.
	if _, err := csi.NewIdentityClient(conn).GetPluginInfo(ctx, &csi.GetPluginInfoRequest{}); err != nil {
		t.Fatal(err)
	}
	// Every call reached the metrics, with its code: the panic too.
	calls.mu.Lock()
	got := strings.Join(calls.calls, ", ")
	calls.mu.Unlock()
	want := "/csi.v1.Controller/CreateVolume OK, /csi.v1.Controller/CreateVolume PermissionDenied, " +
		"/csi.v1.Controller/CreateVolume Internal, /csi.v1.Identity/GetPluginInfo OK"
	if got != want {
		t.Fatalf("observed calls %q, want %q", got, want)
	}
}

// The plugin listens while its node daemon is still being taken over:
// identity and node info answer, Probe says not ready, and a volume call
// waits for the daemon (Unavailable if its caller gives up first), then
// goes through once it is ready.
func TestCallsWaitForTheDaemon(t *testing.T) {
	ready := make(chan struct{})
	r := newRigWith(t, func(c *Config) { c.DaemonReady = ready })
	ctx, _, conn := serveRig(t, r)
	ic, nc := csi.NewIdentityClient(conn), csi.NewNodeClient(conn)
	if _, err := ic.GetPluginInfo(ctx, &csi.GetPluginInfoRequest{}); err != nil {
		t.Fatal(err)
	}
	if p, err := ic.Probe(ctx, &csi.ProbeRequest{}); err != nil || p.GetReady().GetValue() {
		t.Fatalf("Probe while the daemon starts: %v %v, want not ready", p, err)
	}
	if _, err := nc.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{}); err != nil {
		t.Fatal(err)
	}
	v := r.create(t, "pvc-w", 1<<20, map[string]string{"clusterID": "c1"})
	staging := filepath.Join(r.dir, "staging")
	os.Mkdir(staging, 0o750)
	req := r.stageReq(v, staging, mountCap("ext4", rwo))
	short, cancelShort := context.WithTimeout(ctx, 200*time.Millisecond)
	_, err := nc.NodeStageVolume(short, req)
	cancelShort()
	if status.Code(err) != codes.Unavailable && status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("NodeStage before the daemon is ready: %v, want Unavailable or DeadlineExceeded", err)
	}
	if n := r.att.mapped(); n != 0 {
		t.Fatalf("a call reached the daemon before it was ready: %d devices", n)
	}
	done := make(chan error, 1)
	go func() { _, err := nc.NodeStageVolume(ctx, req); done <- err }()
	select {
	case err := <-done:
		t.Fatalf("NodeStage returned before the daemon was ready: %v", err)
	case <-time.After(100 * time.Millisecond):
	}
	close(ready)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if p, err := ic.Probe(ctx, &csi.ProbeRequest{}); err != nil || !p.GetReady().GetValue() {
		t.Fatalf("Probe once the daemon is ready: %v %v", p, err)
	}
}
