package csi

import (
	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// One validator per request type, as ceph-csi has them: each call checks
// its request's fields here first, before it takes a lock or looks
// anything up, so a missing field is InvalidArgument naming it whatever
// else is wrong with the request (csi-sanity sends such requests with
// volume IDs that do not exist, and wants InvalidArgument, not
// NotFound). The checks run in a fixed order, so a request missing
// several fields always names the same one. A validator that has to
// parse a volume capability to check it returns what it parsed, so the
// call does not parse it again.

// missing is the answer for a request without a field it needs.
func missing(field string) error {
	return status.Errorf(codes.InvalidArgument, "%s is required", field)
}

// capability parses a request's volume capability, which is there:
// InvalidArgument if it asks for what this driver cannot do.
func capability(c *csi.VolumeCapability) (access, error) {
	a, err := parseCapability(c)
	if err != nil {
		return access{}, status.Error(codes.InvalidArgument, err.Error())
	}
	return a, nil
}

// validateCreateVolumeRequest returns the parsed capabilities.
func validateCreateVolumeRequest(req *csi.CreateVolumeRequest) ([]access, error) {
	if req.GetName() == "" {
		return nil, missing("volume name")
	}
	accs, err := parseCapabilities(req.GetVolumeCapabilities())
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	return accs, nil
}

func validateDeleteVolumeRequest(req *csi.DeleteVolumeRequest) error {
	if req.GetVolumeId() == "" {
		return missing("volume ID")
	}
	return nil
}

// validateControllerExpandVolumeRequest returns the parsed capability,
// which is optional here: without one, the zero access (a filesystem).
func validateControllerExpandVolumeRequest(req *csi.ControllerExpandVolumeRequest) (access, error) {
	if req.GetVolumeId() == "" {
		return access{}, missing("volume ID")
	}
	if req.GetCapacityRange() == nil || req.GetCapacityRange().GetRequiredBytes() <= 0 {
		return access{}, missing("a capacity range with required bytes")
	}
	if c := req.GetVolumeCapability(); c != nil {
		return capability(c)
	}
	return access{}, nil
}

// validateControllerPublishVolumeRequest returns the parsed capability.
func validateControllerPublishVolumeRequest(req *csi.ControllerPublishVolumeRequest) (access, error) {
	switch {
	case req.GetVolumeId() == "":
		return access{}, missing("volume ID")
	case req.GetNodeId() == "":
		return access{}, missing("node ID")
	case req.GetVolumeCapability() == nil:
		return access{}, missing("volume capability")
	}
	return capability(req.GetVolumeCapability())
}

func validateControllerUnpublishVolumeRequest(req *csi.ControllerUnpublishVolumeRequest) error {
	if req.GetVolumeId() == "" {
		return missing("volume ID")
	}
	return nil
}

// validateValidateVolumeCapabilitiesRequest checks that there are
// capabilities, not what they ask: the answer to a capability this
// driver cannot honour is a response saying so, not an error, and comes
// after the volume is known to exist.
func validateValidateVolumeCapabilitiesRequest(req *csi.ValidateVolumeCapabilitiesRequest) error {
	if req.GetVolumeId() == "" {
		return missing("volume ID")
	}
	if len(req.GetVolumeCapabilities()) == 0 {
		return status.Error(codes.InvalidArgument, "volume capabilities are required")
	}
	return nil
}

// validateNodeStageVolumeRequest returns the parsed capability.
func validateNodeStageVolumeRequest(req *csi.NodeStageVolumeRequest) (access, error) {
	switch {
	case req.GetVolumeId() == "":
		return access{}, missing("volume ID")
	case req.GetStagingTargetPath() == "":
		return access{}, missing("staging target path")
	case req.GetVolumeCapability() == nil:
		return access{}, missing("volume capability")
	}
	return capability(req.GetVolumeCapability())
}

func validateNodeUnstageVolumeRequest(req *csi.NodeUnstageVolumeRequest) error {
	switch {
	case req.GetVolumeId() == "":
		return missing("volume ID")
	case req.GetStagingTargetPath() == "":
		return missing("staging target path")
	}
	return nil
}

// validateNodePublishVolumeRequest returns the parsed capability. A
// missing staging path is named before a capability that cannot be
// honoured.
func validateNodePublishVolumeRequest(req *csi.NodePublishVolumeRequest) (access, error) {
	switch {
	case req.GetVolumeId() == "":
		return access{}, missing("volume ID")
	case req.GetTargetPath() == "":
		return access{}, missing("target path")
	case req.GetVolumeCapability() == nil:
		return access{}, missing("volume capability")
	case req.GetStagingTargetPath() == "":
		return access{}, missing("staging target path")
	}
	return capability(req.GetVolumeCapability())
}

func validateNodeUnpublishVolumeRequest(req *csi.NodeUnpublishVolumeRequest) error {
	switch {
	case req.GetVolumeId() == "":
		return missing("volume ID")
	case req.GetTargetPath() == "":
		return missing("target path")
	}
	return nil
}

func validateNodeGetVolumeStatsRequest(req *csi.NodeGetVolumeStatsRequest) error {
	switch {
	case req.GetVolumeId() == "":
		return missing("volume ID")
	case req.GetVolumePath() == "":
		return missing("volume path")
	}
	return nil
}

func validateNodeExpandVolumeRequest(req *csi.NodeExpandVolumeRequest) error {
	switch {
	case req.GetVolumeId() == "":
		return missing("volume ID")
	case req.GetVolumePath() == "":
		return missing("volume path")
	}
	return nil
}

func validateNodeGetVolumeHealthRequest(req *csi.NodeGetVolumeHealthRequest) error {
	if req.GetVolumeId() == "" {
		return missing("volume ID")
	}
	return nil
}

func validateCreateSnapshotRequest(req *csi.CreateSnapshotRequest) error {
	if req.GetName() == "" {
		return missing("snapshot name")
	}
	if req.GetSourceVolumeId() == "" {
		return missing("source volume ID")
	}
	return nil
}

func validateDeleteSnapshotRequest(req *csi.DeleteSnapshotRequest) error {
	if req.GetSnapshotId() == "" {
		return missing("snapshot ID")
	}
	return nil
}

func validateGetSnapshotRequest(req *csi.GetSnapshotRequest) error {
	if req.GetSnapshotId() == "" {
		return missing("snapshot ID")
	}
	return nil
}
