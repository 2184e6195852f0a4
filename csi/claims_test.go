package csi

import (
	"context"
	"os"
	"slices"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"sigs.k8s.io/yaml"
)

// TestConformanceClaims keeps e2e/k8s/conformance/driver.yaml true. It
// tells Kubernetes' storage tests what this driver can do, and a claim
// the driver dropped would only show as a failure in the VM an hour
// later, while one it never made hides tests for good. Every capability
// the suite knows must be stated; those the driver's answers or its
// CSIDriver object decide are checked both ways against them, and the
// rest (features this driver does not implement) must be false.
func TestConformanceClaims(t *testing.T) {
	var def struct {
		DriverInfo struct {
			Name            string
			SupportedFsType map[string]struct{}
			Capabilities    map[string]bool
		}
	}
	readYAML(t, "../e2e/k8s/conformance/driver.yaml", &def)
	if def.DriverInfo.Name != DefaultDriverName {
		t.Errorf("driver.yaml names %q, the driver is %q", def.DriverInfo.Name, DefaultDriverName)
	}
	for fs := range def.DriverInfo.SupportedFsType {
		if fs != "" && !fsSupported(fs) {
			t.Errorf("driver.yaml claims fstype %s, which NodeStage does not format", fs)
		}
	}
	for _, fs := range []string{"ext4", "xfs"} {
		if _, ok := def.DriverInfo.SupportedFsType[fs]; !ok {
			t.Errorf("driver.yaml leaves out fstype %s, which the driver supports", fs)
		}
	}

	var csiDriver struct {
		Spec struct {
			FSGroupPolicy   string
			StorageCapacity bool
			SELinuxMount    bool
		}
	}
	readYAML(t, "../deploy/kubernetes/csidriver.yaml", &csiDriver)

	r := newRig(t)
	ctx := context.Background()
	cc, _ := r.d.ControllerGetCapabilities(ctx, nil)
	nc, _ := r.d.NodeGetCapabilities(ctx, nil)
	pc, _ := r.d.GetPluginCapabilities(ctx, nil)
	info, _ := r.d.NodeGetInfo(ctx, nil)
	ctrl := func(c csi.ControllerServiceCapability_RPC_Type) bool {
		return slices.ContainsFunc(cc.GetCapabilities(), func(x *csi.ControllerServiceCapability) bool { return x.GetRpc().GetType() == c })
	}
	node := func(c csi.NodeServiceCapability_RPC_Type) bool {
		return slices.ContainsFunc(nc.GetCapabilities(), func(x *csi.NodeServiceCapability) bool { return x.GetRpc().GetType() == c })
	}
	expansion := func(c csi.PluginCapability_VolumeExpansion_Type) bool {
		return slices.ContainsFunc(pc.GetCapabilities(), func(x *csi.PluginCapability) bool { return x.GetVolumeExpansion().GetType() == c })
	}
	accepts := func(c *csi.VolumeCapability) bool { _, err := parseCapability(c); return err == nil }

	checked := map[string]bool{}
	for name, does := range map[string]bool{
		"persistence":      true,
		"exec":             true,
		"multipods":        true,
		"fsGroup":          csiDriver.Spec.FSGroupPolicy == "File" || csiDriver.Spec.FSGroupPolicy == "ReadWriteOnceWithFSType",
		"volumeMountGroup": node(csi.NodeServiceCapability_RPC_VOLUME_MOUNT_GROUP),
		"capacity":         csiDriver.Spec.StorageCapacity,
		"seLinuxMount":     csiDriver.Spec.SELinuxMount,
		// Not implemented: volume group snapshots, snapshot metadata,
		// two PVs of one volume handle staged at once; and a volume is
		// not bound to the node that made it.
		"groupSnapshot":       false,
		"snapshotMetadata":    false,
		"multiplePVsSameID":   false,
		"singleNodeVolume":    false,
		"block":               accepts(blockCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)),
		"snapshotDataSource":  ctrl(csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT),
		"pvcDataSource":       ctrl(csi.ControllerServiceCapability_RPC_CLONE_VOLUME),
		"controllerExpansion": ctrl(csi.ControllerServiceCapability_RPC_EXPAND_VOLUME),
		"nodeExpansion":       node(csi.NodeServiceCapability_RPC_EXPAND_VOLUME),
		"onlineExpansion":     expansion(csi.PluginCapability_VolumeExpansion_ONLINE),
		"offlineExpansion":    expansion(csi.PluginCapability_VolumeExpansion_OFFLINE),
		"readWriteOncePod": ctrl(csi.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER) &&
			node(csi.NodeServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER) &&
			accepts(mountCap("ext4", csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER)),
		"capReadOnlyMany": accepts(mountCap("ext4", csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY)),
		// The suite's RWX specs mount filesystems as well as block.
		"RWX": accepts(mountCap("ext4", csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)) &&
			accepts(blockCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)),
		"volumeLimits": info.GetMaxVolumesPerNode() > 0,
		"topology":     info.GetAccessibleTopology() != nil,
	} {
		checked[name] = true
		claimed, listed := def.DriverInfo.Capabilities[name]
		if !listed {
			t.Errorf("driver.yaml does not say whether the driver has %s (it does: %v)", name, does)
		} else if claimed != does {
			t.Errorf("driver.yaml claims %s: %v, the driver: %v", name, claimed, does)
		}
	}
	// A capability the suite does not know (a typo) would be ignored.
	for name := range def.DriverInfo.Capabilities {
		if !checked[name] {
			t.Errorf("driver.yaml states %s, which the suite has no capability of that name for", name)
		}
	}
}

func readYAML(t *testing.T, path string, v any) {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(raw, v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}
