package kubelet

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// TestRegistration plays the kubelet's plugin watcher against Serve.
func TestRegistration(t *testing.T) {
	dir := t.TempDir()
	r := &Registration{Driver: "rbd-nbd-go.csi.io", Endpoint: "/var/lib/kubelet/plugins/rbd-nbd-go.csi.io/csi.sock"}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Serve(ctx, dir) }()

	sock := filepath.Join(dir, "rbd-nbd-go.csi.io-reg.sock")
	waitFor(t, func() bool { _, err := os.Stat(sock); return err == nil })
	fi, err := os.Stat(sock)
	if err != nil || fi.Mode().Perm()&0o077 != 0 {
		t.Fatalf("socket %v mode %v: not private", err, fi.Mode())
	}
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	c := registerapi.NewRegistrationClient(conn)
	info, err := c.GetInfo(ctx, &registerapi.InfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if info.Type != registerapi.CSIPlugin || info.Name != r.Driver || info.Endpoint != r.Endpoint || len(info.SupportedVersions) == 0 {
		t.Fatalf("GetInfo = %+v", info)
	}
	for _, ok := range []bool{true, false} {
		if _, err := c.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: ok, Error: "x"}); err != nil {
			t.Fatal(err)
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Serve: %v", err)
	}
	if _, err := os.Stat(sock); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("socket left behind after a clean stop: %v", err)
	}
}

func TestRegistrationBadConfig(t *testing.T) {
	r := &Registration{Driver: "d", Endpoint: "csi.sock"}
	if err := r.Serve(context.Background(), t.TempDir()); err == nil {
		t.Fatal("a relative endpoint was accepted")
	}
}

// probeServer answers Probe with whatever the test sets.
type probeServer struct {
	csi.UnimplementedIdentityServer
	resp *csi.ProbeResponse
	err  error
}

func (p *probeServer) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return p.resp, p.err
}

func TestLiveness(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "csi.sock")
	pl, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	ps := &probeServer{}
	gs := grpc.NewServer()
	csi.RegisterIdentityServer(gs, ps)
	go gs.Serve(pl)
	defer gs.Stop()

	hl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	lv := &Liveness{CSIAddress: sock, ProbeTimeout: 2 * time.Second}
	go lv.Serve(ctx, hl)
	url := "http://" + hl.Addr().String() + "/healthz"

	for _, c := range []struct {
		name string
		resp *csi.ProbeResponse
		err  error
		want int
	}{
		{"ready", &csi.ProbeResponse{Ready: wrapperspb.Bool(true)}, nil, 200},
		{"silent means ready", &csi.ProbeResponse{}, nil, 200},
		{"not ready", &csi.ProbeResponse{Ready: wrapperspb.Bool(false)}, nil, 500},
		{"error", nil, status.Error(codes.FailedPrecondition, "no daemon"), 500},
	} {
		ps.resp, ps.err = c.resp, c.err
		resp, err := http.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != c.want {
			t.Errorf("%s: %d %q, want %d", c.name, resp.StatusCode, body, c.want)
		}
		if c.err != nil && !strings.Contains(string(body), "no daemon") {
			t.Errorf("%s: body %q lacks the reason", c.name, body)
		}
		// The exec probe's answer is the same.
		if err := lv.Once(ctx); (err == nil) != (c.want == 200) {
			t.Errorf("%s: Once says %v, want ok=%v", c.name, err, c.want == 200)
		}
	}
	// A plugin that is gone fails the probe rather than hanging it.
	gs.Stop()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 500 {
		t.Fatalf("plugin gone: %d", resp.StatusCode)
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	for i := 0; i < 200; i++ {
		if cond() {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatal("timed out")
}
