package csi

import (
	"context"
	"os"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
)

// TestControllerProbeDoesNotAskCeph: the controller's Probe is its
// liveness, so a cluster its credentials cannot reach (here: a wrong key,
// which every image call would refuse) leaves it ready; a clusters config
// that does not read makes it fail, naming why.
func TestControllerProbeDoesNotAskCeph(t *testing.T) {
	sec := controllerSecret(t.TempDir(), "csi", "AQDwrongkey")
	r := newRigWith(t, func(c *Config) { c.Node = false; c.ControllerSecretDir = sec })
	ctx := context.Background()
	if r.images.goodKey == "AQDwrongkey" {
		t.Fatal("the fake takes this key: the test proves nothing")
	}
	p, err := r.d.Probe(ctx, &csi.ProbeRequest{})
	if err != nil || !p.GetReady().GetValue() {
		t.Fatalf("Probe with a key Ceph would refuse: %v %v, want ready", p, err)
	}
	os.WriteFile(r.d.cfg.ClustersConfig, []byte("not json"), 0o600)
	_, err = r.d.Probe(ctx, &csi.ProbeRequest{})
	wantCode(t, "Probe with an unreadable clusters config", err, codes.FailedPrecondition)
}
