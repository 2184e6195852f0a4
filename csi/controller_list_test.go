package csi

import (
	"context"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
)

func TestListVolumesAndCapacity(t *testing.T) {
	r := newRig(t)
	ctx := context.Background()
	for _, n := range []string{"a", "b", "c", "d", "e"} {
		r.create(t, n, 1<<20, nil)
	}
	var ids []string
	token := ""
	for {
		resp, err := r.d.ListVolumes(ctx, &csi.ListVolumesRequest{MaxEntries: 2, StartingToken: token})
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range resp.Entries {
			ids = append(ids, e.Volume.VolumeId)
		}
		if token = resp.NextToken; token == "" {
			break
		}
	}
	if len(ids) != 5 {
		t.Fatalf("listed %v", ids)
	}
	_, err := r.d.ListVolumes(ctx, &csi.ListVolumesRequest{StartingToken: "invalid-token"})
	wantCode(t, "bad token", err, codes.Aborted)
	_, err = r.d.ListVolumes(ctx, &csi.ListVolumesRequest{StartingToken: "99"})
	wantCode(t, "token past the end", err, codes.Aborted)
	resp, err := r.d.GetCapacity(ctx, &csi.GetCapacityRequest{Parameters: map[string]string{"clusterID": "c1", "pool": "rbd"}})
	if err != nil || resp.AvailableCapacity != 5<<30 {
		t.Fatalf("capacity %+v %v", resp, err)
	}
	if resp, err := r.d.GetCapacity(ctx, &csi.GetCapacityRequest{}); err != nil || resp.AvailableCapacity != 0 {
		t.Fatalf("capacity without parameters %+v %v", resp, err)
	}
	_, err = r.d.GetCapacity(ctx, &csi.GetCapacityRequest{Parameters: map[string]string{"clusterID": "ns"}})
	wantCode(t, "no credentials yet", err, codes.Unavailable)
	// A restarted controller with its own Secret lists at once.
	cfg := r.d.cfg
	cfg.ControllerSecretDir = controllerSecret(r.dir, "csi", "AQDkey")
	d2, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if resp, err := d2.ListVolumes(ctx, &csi.ListVolumesRequest{}); err != nil || len(resp.Entries) != 5 {
		t.Fatalf("a fresh controller with a Secret lists %v %v", resp, err)
	}
}
