package csi

import (
	"context"
	"sort"
	"strconv"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
)

// ListVolumes lists the images carrying a CSI name in every pool of
// every cluster in the config that there are credentials for (the
// controller's Secret, else the last ones seen), by volume ID. The token
// is the index of the next entry.
func (d *Driver) ListVolumes(ctx context.Context, req *csi.ListVolumesRequest) (*csi.ListVolumesResponse, error) {
	start := 0
	if t := req.GetStartingToken(); t != "" {
		n, err := strconv.Atoi(t)
		if err != nil || n < 0 {
			return nil, status.Errorf(codes.Aborted, "bad starting token %q", t)
		}
		start = n
	}
	if req.GetMaxEntries() < 0 {
		return nil, status.Error(codes.InvalidArgument, "max entries cannot be negative")
	}
	vols, err := d.allVolumes()
	if err != nil {
		return nil, err
	}
	if start > len(vols) {
		return nil, status.Errorf(codes.Aborted, "starting token %d is past the %d volumes", start, len(vols))
	}
	end := pageEnd(start, len(vols), req.GetMaxEntries())
	resp := &csi.ListVolumesResponse{}
	for _, v := range vols[start:end] {
		resp.Entries = append(resp.Entries, &csi.ListVolumesResponse_Entry{Volume: v})
	}
	if end < len(vols) {
		resp.NextToken = strconv.Itoa(end)
	}
	return resp, nil
}

// pageEnd is where a page starting at start ends, of n entries, for a
// list call's max_entries (0: no limit).
func pageEnd(start, n int, maxEntries int32) int {
	if m := int(maxEntries); m > 0 && start+m < n {
		return start + m
	}
	return n
}

func (d *Driver) allVolumes() ([]*csi.Volume, error) {
	cs, err := d.clusters.load()
	if err != nil {
		return nil, status.Error(codes.FailedPrecondition, err.Error())
	}
	var vols []*csi.Volume
	for _, cl := range cs {
		creds, ok := d.knownCreds(cl.ClusterID)
		if !ok || len(cl.Monitors) == 0 {
			continue
		}
		o := cl.options(creds, controllerOSDTimeout)
		pools, err := d.cfg.Images.ListPools(o)
		if err != nil {
			return nil, cephStatus(err, "list pools of cluster "+cl.ClusterID)
		}
		for _, pool := range pools {
			infos, err := d.cfg.Images.ListImages(o, ceph.ImageSpec{Pool: pool, Namespace: cl.RBD.RadosNamespace}, metaName)
			if err != nil {
				continue // not an RBD pool (or not ours to read)
			}
			for _, info := range infos {
				if strings.HasPrefix(info.Spec.Image, gonePrefix) {
					continue // a deleted volume's image, kept for its snapshots
				}
				vols = append(vols, &csi.Volume{VolumeId: volume{ClusterID: cl.ClusterID, Spec: info.Spec}.ID(),
					CapacityBytes: int64(usableBytes(info.Size, info.Meta))})
			}
		}
	}
	sort.Slice(vols, func(i, j int) bool { return vols[i].VolumeId < vols[j].VolumeId })
	return vols, nil
}

// GetCapacity is the free space of the StorageClass's pool. It needs
// credentials seen for the cluster (the request carries none); without
// parameters it reports nothing (0).
func (d *Driver) GetCapacity(ctx context.Context, req *csi.GetCapacityRequest) (*csi.GetCapacityResponse, error) {
	if len(req.GetParameters()) == 0 {
		return &csi.GetCapacityResponse{}, nil
	}
	if len(req.GetVolumeCapabilities()) > 0 {
		if _, err := parseCapabilities(req.GetVolumeCapabilities()); err != nil {
			return &csi.GetCapacityResponse{}, nil // none for what cannot be provisioned
		}
	}
	p, err := parseParams(req.GetParameters(), d.mapDefaults())
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	cl, err := d.clusters.get(p.ClusterID)
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	creds, ok := d.knownCreds(p.ClusterID)
	if !ok {
		return nil, status.Errorf(codes.Unavailable, "no credentials seen for cluster %q yet", p.ClusterID)
	}
	avail, err := d.cfg.Images.PoolAvailable(cl.options(creds, controllerOSDTimeout), p.Pool)
	if err != nil {
		return nil, cephStatus(err, "free space of pool "+p.Pool)
	}
	return &csi.GetCapacityResponse{AvailableCapacity: int64(avail)}, nil
}

func (d *Driver) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	var caps []*csi.ControllerServiceCapability
	for _, t := range []csi.ControllerServiceCapability_RPC_Type{
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME,
		csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME,
		csi.ControllerServiceCapability_RPC_LIST_VOLUMES,
		csi.ControllerServiceCapability_RPC_GET_CAPACITY,
		csi.ControllerServiceCapability_RPC_EXPAND_VOLUME,
		csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
		csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT,
		csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS,
		csi.ControllerServiceCapability_RPC_GET_SNAPSHOT,
		csi.ControllerServiceCapability_RPC_CLONE_VOLUME,
		csi.ControllerServiceCapability_RPC_MODIFY_VOLUME,
	} {
		caps = append(caps, &csi.ControllerServiceCapability{Type: &csi.ControllerServiceCapability_Rpc{
			Rpc: &csi.ControllerServiceCapability_RPC{Type: t}}})
	}
	return &csi.ControllerGetCapabilitiesResponse{Capabilities: caps}, nil
}
