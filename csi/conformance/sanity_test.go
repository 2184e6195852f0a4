// Package conformance runs upstream csi-sanity (kubernetes-csi/csi-test
// v5 pkg/sanity) against the real `rbd-nbd-go csi` binary and a real
// dev Ceph cluster. The two runs make the whole suite between them: on
// the host the controller half (this kernel has no NBD); in the VM
// (RBD_NBD_GO_CSI_NODE=1, scripts/vm) the node and identity halves, on
// real /dev/nbd devices with real mkfs and mounts, once with mount
// access and once with raw block access.
package conformance

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"
	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
)

func TestSanity(t *testing.T) {
	node := onNode()
	dir := t.TempDir()
	// On the host the node service runs too (sanity cleans up through
	// it), but its daemon cannot start: no NBD; its tests are skipped.
	endpoint := "unix://" + startPlugin(t, dir).sock
	secrets := fmt.Sprintf("{userID: admin, userKey: %q}", cluster.key)
	secretsFile := filepath.Join(dir, "secrets.yaml")
	var b bytes.Buffer
	for _, k := range []string{"CreateVolumeSecret", "DeleteVolumeSecret", "ControllerPublishVolumeSecret",
		"ControllerUnpublishVolumeSecret", "ControllerValidateVolumeCapabilitiesSecret", "NodeStageVolumeSecret",
		"NodePublishVolumeSecret", "ControllerExpandVolumeSecret", "CreateSnapshotSecret", "DeleteSnapshotSecret",
		"ListSnapshotsSecret", "GetSnapshotSecret", "ControllerModifyVolumeSecret"} {
		fmt.Fprintf(&b, "%s: %s\n", k, secrets)
	}
	os.WriteFile(secretsFile, []byte(b.String()), 0o600)
	configs := map[string]*sanity.TestConfig{}
	for _, access := range []string{"mount", "block"} {
		cfg := sanity.NewTestConfig()
		cfg.Address = endpoint
		cfg.TargetPath = filepath.Join(dir, access, "target")
		cfg.StagingPath = filepath.Join(dir, access, "staging")
		os.MkdirAll(filepath.Join(dir, access), 0o755)
		cfg.SecretsFile = secretsFile
		cfg.TestVolumeParameters = map[string]string{"clusterID": "dev", "pool": "rbd"}
		// A VolumeSnapshotClass's parameters, ceph-csi's names.
		cfg.TestSnapshotParameters = map[string]string{"clusterID": "dev", "snapshotNamePrefix": "sanity-"}
		// A VolumeAttributesClass's: runs the ModifyVolume specs.
		cfg.TestVolumeMutableParameters = map[string]string{"maxIops": "500"}
		// Small volumes: mkfs and the memstore OSD stay quick under TCG.
		cfg.TestVolumeSize = 64 << 20
		cfg.TestVolumeExpandSize = 128 << 20
		cfg.TestVolumeAccessType = access
		cfg.IdempotentCount = 3
		configs[access] = &cfg
	}
	Describe("mount access", func() { sanity.GinkgoTest(configs["mount"]) })
	if node {
		// Only the node tests differ by access type.
		Describe("block access", Label("block"), func() { sanity.GinkgoTest(configs["block"]) })
	}
	RegisterFailHandler(Fail)
	suite, reporter := GinkgoConfiguration()
	if !node {
		// No NBD in this kernel: the node half runs in the VM.
		// Probe too: the node role is ready only when its daemon runs,
		// and it cannot here.
		suite.SkipStrings = append(suite.SkipStrings, "Node Service", "Probe")
	} else {
		// The controller specs never call the node (csi-test's
		// controller.go), and the host ran them against the same code
		// and Ceph: here they would only repeat, at TCG's pace, twice.
		suite.FocusStrings = append(suite.FocusStrings, "Node Service", "Identity Service")
	}
	suite.Timeout = 40 * time.Minute
	RunSpecs(t, "rbd-nbd-go CSI sanity", suite, reporter)
}
