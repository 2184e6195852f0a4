package csi

import (
	"context"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

func (d *Driver) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: d.cfg.Name, VendorVersion: d.cfg.Version}, nil
}

func (d *Driver) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	var caps []*csi.PluginCapability
	if d.cfg.Controller {
		caps = append(caps, &csi.PluginCapability{Type: &csi.PluginCapability_Service_{
			Service: &csi.PluginCapability_Service{Type: csi.PluginCapability_Service_CONTROLLER_SERVICE}}})
	}
	for _, t := range []csi.PluginCapability_VolumeExpansion_Type{
		csi.PluginCapability_VolumeExpansion_ONLINE, csi.PluginCapability_VolumeExpansion_OFFLINE} {
		caps = append(caps, &csi.PluginCapability{Type: &csi.PluginCapability_VolumeExpansion_{
			VolumeExpansion: &csi.PluginCapability_VolumeExpansion{Type: t}}})
	}
	return &csi.GetPluginCapabilitiesResponse{Capabilities: caps}, nil
}

// Probe is ready when what the role needs is up: for the node, the node
// daemon answers; for the controller, the clusters config reads.
//
// The controller's Probe does not reach Ceph. Its caller is the liveness
// check, and a kubelet that kills the controller for a slow or
// unreachable cluster fixes nothing and aborts its clones, flattens and
// deletes half-way. Asking Ceph meant a connect per probe: under TCG,
// beside Kubernetes' storage tests, those took over the probe's 5 s, and
// the kubelet killed a healthy controller twice in one run. ceph-csi's
// Probe does not ask Ceph either. A cluster the controller cannot reach
// shows in its calls' errors, which name it.
func (d *Driver) Probe(ctx context.Context, _ *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	if d.cfg.Node {
		if !d.daemonReady() {
			return &csi.ProbeResponse{Ready: wrapperspb.Bool(false)}, nil
		}
		if err := d.cfg.Daemon.Ping(ctx); err != nil {
			return nil, status.Errorf(codes.FailedPrecondition, "the node daemon does not answer: %v", err)
		}
	}
	if d.cfg.Controller {
		if _, err := d.clusters.load(); err != nil {
			return nil, status.Errorf(codes.FailedPrecondition, "%v", err)
		}
	}
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(true)}, nil
}
