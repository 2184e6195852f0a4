package csi

import (
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
)

// errOf drops what a validator parsed.
func errOf[T any](_ T, err error) error { return err }

// TestValidators: a complete request passes; each missing field is
// InvalidArgument naming it, the first missing one when several are.
func TestValidators(t *testing.T) {
	c, bad := mountCap("ext4", rwo), mountCap("vfat", rwo)
	caps := []*csi.VolumeCapability{c}
	cr := &csi.CapacityRange{RequiredBytes: 1 << 20}
	for _, tc := range []struct {
		name string
		err  error
		says string // empty: the request passes
	}{
		{"create", errOf(validateCreateVolumeRequest(&csi.CreateVolumeRequest{Name: "n", VolumeCapabilities: caps})), ""},
		{"create: name", errOf(validateCreateVolumeRequest(&csi.CreateVolumeRequest{VolumeCapabilities: caps})), "volume name is required"},
		{"create: capabilities", errOf(validateCreateVolumeRequest(&csi.CreateVolumeRequest{Name: "n"})), "unsupported volume capability: none given"},
		{"create: bad capability", errOf(validateCreateVolumeRequest(&csi.CreateVolumeRequest{Name: "n",
			VolumeCapabilities: []*csi.VolumeCapability{c, bad}})), `filesystem "vfat"`},
		{"create: nothing", errOf(validateCreateVolumeRequest(&csi.CreateVolumeRequest{})), "volume name is required"},

		{"delete", validateDeleteVolumeRequest(&csi.DeleteVolumeRequest{VolumeId: "v"}), ""},
		{"delete: volume ID", validateDeleteVolumeRequest(&csi.DeleteVolumeRequest{}), "volume ID is required"},

		{"controller expand", errOf(validateControllerExpandVolumeRequest(&csi.ControllerExpandVolumeRequest{VolumeId: "v", CapacityRange: cr})), ""},
		{"controller expand: volume ID", errOf(validateControllerExpandVolumeRequest(&csi.ControllerExpandVolumeRequest{CapacityRange: cr})), "volume ID is required"},
		{"controller expand: capacity", errOf(validateControllerExpandVolumeRequest(&csi.ControllerExpandVolumeRequest{VolumeId: "v"})),
			"a capacity range with required bytes is required"},
		{"controller expand: zero bytes", errOf(validateControllerExpandVolumeRequest(&csi.ControllerExpandVolumeRequest{VolumeId: "v",
			CapacityRange: &csi.CapacityRange{LimitBytes: 1 << 20}})), "a capacity range with required bytes is required"},
		{"controller expand: bad capability", errOf(validateControllerExpandVolumeRequest(&csi.ControllerExpandVolumeRequest{VolumeId: "v",
			CapacityRange: cr, VolumeCapability: bad})), `filesystem "vfat"`},

		{"controller publish", errOf(validateControllerPublishVolumeRequest(&csi.ControllerPublishVolumeRequest{VolumeId: "v", NodeId: "n",
			VolumeCapability: c})), ""},
		{"controller publish: volume ID", errOf(validateControllerPublishVolumeRequest(&csi.ControllerPublishVolumeRequest{NodeId: "n",
			VolumeCapability: c})), "volume ID is required"},
		{"controller publish: node ID", errOf(validateControllerPublishVolumeRequest(&csi.ControllerPublishVolumeRequest{VolumeId: "v",
			VolumeCapability: c})), "node ID is required"},
		{"controller publish: capability", errOf(validateControllerPublishVolumeRequest(&csi.ControllerPublishVolumeRequest{VolumeId: "v",
			NodeId: "n"})), "volume capability is required"},
		{"controller publish: bad capability", errOf(validateControllerPublishVolumeRequest(&csi.ControllerPublishVolumeRequest{VolumeId: "v",
			NodeId: "n", VolumeCapability: bad})), `filesystem "vfat"`},

		{"controller unpublish", validateControllerUnpublishVolumeRequest(&csi.ControllerUnpublishVolumeRequest{VolumeId: "v"}), ""},
		{"controller unpublish: volume ID", validateControllerUnpublishVolumeRequest(&csi.ControllerUnpublishVolumeRequest{NodeId: "n"}),
			"volume ID is required"},

		{"validate capabilities", validateValidateVolumeCapabilitiesRequest(&csi.ValidateVolumeCapabilitiesRequest{VolumeId: "v",
			VolumeCapabilities: caps}), ""},
		// What a capability asks is answered in the response, not here.
		{"validate capabilities: unsupported ones", validateValidateVolumeCapabilitiesRequest(&csi.ValidateVolumeCapabilitiesRequest{
			VolumeId: "v", VolumeCapabilities: []*csi.VolumeCapability{bad}}), ""},
		{"validate capabilities: volume ID", validateValidateVolumeCapabilitiesRequest(&csi.ValidateVolumeCapabilitiesRequest{
			VolumeCapabilities: caps}), "volume ID is required"},
		{"validate capabilities: capabilities", validateValidateVolumeCapabilitiesRequest(&csi.ValidateVolumeCapabilitiesRequest{
			VolumeId: "v"}), "volume capabilities are required"},

		{"stage", errOf(validateNodeStageVolumeRequest(&csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: "/s",
			VolumeCapability: c})), ""},
		{"stage: volume ID", errOf(validateNodeStageVolumeRequest(&csi.NodeStageVolumeRequest{StagingTargetPath: "/s",
			VolumeCapability: c})), "volume ID is required"},
		{"stage: staging path", errOf(validateNodeStageVolumeRequest(&csi.NodeStageVolumeRequest{VolumeId: "v",
			VolumeCapability: c})), "staging target path is required"},
		{"stage: capability", errOf(validateNodeStageVolumeRequest(&csi.NodeStageVolumeRequest{VolumeId: "v",
			StagingTargetPath: "/s"})), "volume capability is required"},
		{"stage: bad capability", errOf(validateNodeStageVolumeRequest(&csi.NodeStageVolumeRequest{VolumeId: "v",
			StagingTargetPath: "/s", VolumeCapability: bad})), `filesystem "vfat"`},
		{"stage: nothing", errOf(validateNodeStageVolumeRequest(&csi.NodeStageVolumeRequest{})), "volume ID is required"},

		{"unstage", validateNodeUnstageVolumeRequest(&csi.NodeUnstageVolumeRequest{VolumeId: "v", StagingTargetPath: "/s"}), ""},
		{"unstage: volume ID", validateNodeUnstageVolumeRequest(&csi.NodeUnstageVolumeRequest{StagingTargetPath: "/s"}),
			"volume ID is required"},
		{"unstage: staging path", validateNodeUnstageVolumeRequest(&csi.NodeUnstageVolumeRequest{VolumeId: "v"}),
			"staging target path is required"},

		{"publish", errOf(validateNodePublishVolumeRequest(&csi.NodePublishVolumeRequest{VolumeId: "v", TargetPath: "/t",
			StagingTargetPath: "/s", VolumeCapability: c})), ""},
		{"publish: volume ID", errOf(validateNodePublishVolumeRequest(&csi.NodePublishVolumeRequest{TargetPath: "/t",
			StagingTargetPath: "/s", VolumeCapability: c})), "volume ID is required"},
		{"publish: target path", errOf(validateNodePublishVolumeRequest(&csi.NodePublishVolumeRequest{VolumeId: "v",
			StagingTargetPath: "/s", VolumeCapability: c})), "target path is required"},
		{"publish: capability", errOf(validateNodePublishVolumeRequest(&csi.NodePublishVolumeRequest{VolumeId: "v",
			TargetPath: "/t", StagingTargetPath: "/s"})), "volume capability is required"},
		{"publish: staging path", errOf(validateNodePublishVolumeRequest(&csi.NodePublishVolumeRequest{VolumeId: "v",
			TargetPath: "/t", VolumeCapability: c})), "staging target path is required"},
		{"publish: staging path before a bad capability", errOf(validateNodePublishVolumeRequest(&csi.NodePublishVolumeRequest{
			VolumeId: "v", TargetPath: "/t", VolumeCapability: bad})), "staging target path is required"},
		{"publish: bad capability", errOf(validateNodePublishVolumeRequest(&csi.NodePublishVolumeRequest{VolumeId: "v",
			TargetPath: "/t", StagingTargetPath: "/s", VolumeCapability: bad})), `filesystem "vfat"`},

		{"unpublish", validateNodeUnpublishVolumeRequest(&csi.NodeUnpublishVolumeRequest{VolumeId: "v", TargetPath: "/t"}), ""},
		{"unpublish: volume ID", validateNodeUnpublishVolumeRequest(&csi.NodeUnpublishVolumeRequest{TargetPath: "/t"}),
			"volume ID is required"},
		{"unpublish: target path", validateNodeUnpublishVolumeRequest(&csi.NodeUnpublishVolumeRequest{VolumeId: "v"}),
			"target path is required"},

		{"stats", validateNodeGetVolumeStatsRequest(&csi.NodeGetVolumeStatsRequest{VolumeId: "v", VolumePath: "/p"}), ""},
		{"stats: volume ID", validateNodeGetVolumeStatsRequest(&csi.NodeGetVolumeStatsRequest{VolumePath: "/p"}),
			"volume ID is required"},
		{"stats: volume path", validateNodeGetVolumeStatsRequest(&csi.NodeGetVolumeStatsRequest{VolumeId: "v"}),
			"volume path is required"},

		{"node expand", validateNodeExpandVolumeRequest(&csi.NodeExpandVolumeRequest{VolumeId: "v", VolumePath: "/p"}), ""},
		{"node expand: volume ID", validateNodeExpandVolumeRequest(&csi.NodeExpandVolumeRequest{VolumePath: "/p"}),
			"volume ID is required"},
		{"node expand: volume path", validateNodeExpandVolumeRequest(&csi.NodeExpandVolumeRequest{VolumeId: "v"}),
			"volume path is required"},

		{"health", validateNodeGetVolumeHealthRequest(&csi.NodeGetVolumeHealthRequest{VolumeId: "v"}), ""},
		{"health: volume ID", validateNodeGetVolumeHealthRequest(&csi.NodeGetVolumeHealthRequest{}), "volume ID is required"},
	} {
		if tc.says == "" {
			if tc.err != nil {
				t.Errorf("%s: %v", tc.name, tc.err)
			}
			continue
		}
		wantCode(t, tc.name, tc.err, codes.InvalidArgument, tc.says)
	}
}

// TestValidatorsReturnTheCapability: what a validator parsed is what the
// call acts on.
func TestValidatorsReturnTheCapability(t *testing.T) {
	block, ro := blockCap(rwo), mountCap("xfs", csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY)
	accs, err := validateCreateVolumeRequest(&csi.CreateVolumeRequest{Name: "n", VolumeCapabilities: []*csi.VolumeCapability{block, ro}})
	if err != nil || len(accs) != 2 || !accs[0].Block || !accs[0].Exclusive || !accs[1].ReadOnly || accs[1].FsType != "xfs" {
		t.Errorf("create: %+v %v", accs, err)
	}
	cr := &csi.CapacityRange{RequiredBytes: 1 << 20}
	if a, err := validateControllerExpandVolumeRequest(&csi.ControllerExpandVolumeRequest{VolumeId: "v", CapacityRange: cr}); err != nil || a.Block {
		t.Errorf("controller expand without a capability: %+v %v", a, err)
	}
	if a, err := validateControllerExpandVolumeRequest(&csi.ControllerExpandVolumeRequest{VolumeId: "v", CapacityRange: cr,
		VolumeCapability: block}); err != nil || !a.Block {
		t.Errorf("controller expand of a block volume: %+v %v", a, err)
	}
	if a, err := validateControllerPublishVolumeRequest(&csi.ControllerPublishVolumeRequest{VolumeId: "v", NodeId: "n",
		VolumeCapability: ro}); err != nil || !a.ReadOnly {
		t.Errorf("controller publish: %+v %v", a, err)
	}
	if a, err := validateNodeStageVolumeRequest(&csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: "/s",
		VolumeCapability: block}); err != nil || !a.Block {
		t.Errorf("stage: %+v %v", a, err)
	}
	if a, err := validateNodePublishVolumeRequest(&csi.NodePublishVolumeRequest{VolumeId: "v", TargetPath: "/t",
		StagingTargetPath: "/s", VolumeCapability: ro}); err != nil || !a.ReadOnly || a.FsType != "xfs" {
		t.Errorf("publish: %+v %v", a, err)
	}
}
