// Package conformance runs upstream csi-sanity (kubernetes-csi/csi-test
// v5 pkg/sanity) against the real `rbd-nbd-go csi` binary and a real
// dev Ceph cluster. On the host it runs the controller half (this
// kernel has no NBD); in the VM (RBD_NBD_GO_CSI_NODE=1, scripts/vm) the
// whole suite runs, node service included, on real /dev/nbd devices,
// with real mkfs and mounts — once with mount access and once with raw
// block access.
package conformance

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"
	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"

	"github.com/rbd-nbd-go/rbd-nbd-go/internal/cephtest"
)

var binary string

func TestMain(m *testing.M) {
	binary = os.Getenv("RBD_NBD_GO_BIN")
	dir := ""
	if binary == "" {
		var err error
		if dir, err = os.MkdirTemp("", "rbd-nbd-go-sanity-"); err != nil {
			panic(err)
		}
		binary = filepath.Join(dir, "rbd-nbd-go")
		build := exec.Command("go", "build", "-o", binary, "../../cmd/rbd-nbd-go")
		build.Stderr = os.Stderr
		if err := build.Run(); err != nil {
			fmt.Fprintln(os.Stderr, "building rbd-nbd-go:", err)
			os.Exit(1)
		}
	}
	code := m.Run()
	if dir != "" {
		os.RemoveAll(dir)
	}
	os.Exit(code)
}

// monHost reads the monitor addresses from a ceph.conf.
func monHost(conf string) (string, error) {
	f, err := os.Open(conf)
	if err != nil {
		return "", err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), "=")
		if ok && strings.ReplaceAll(strings.TrimSpace(k), "_", " ") == "mon host" {
			return strings.TrimSpace(v), nil
		}
	}
	return "", fmt.Errorf("no mon host in %s", conf)
}

// plugin starts `rbd-nbd-go csi` and returns its endpoint.
func plugin(t *testing.T, dir string, node bool, monitors, secretKey string) string {
	t.Helper()
	conf := filepath.Join(dir, "config.json")
	os.WriteFile(conf, []byte(fmt.Sprintf(`[{"clusterID":"dev","monitors":[%q]}]`, monitors)), 0o600)
	sock := filepath.Join(dir, "csi.sock")
	args := []string{"--state-dir", filepath.Join(dir, "state"), "--log-level", "debug", "csi",
		"--controllerserver", "--endpoint", "unix://" + sock, "--clusters-config", conf,
		"--node-registry", filepath.Join(dir, "nodes"), "--nodeserver", "--nodeid", "sanity-node"}
	// On the host the node service runs too (sanity cleans up through
	// it), but its daemon cannot start: no NBD; its tests are skipped.
	log, err := os.Create(filepath.Join(dir, "plugin.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(binary, args...)
	cmd.Stdout, cmd.Stderr = log, log
	// No CEPH_CONF: the plugin must work from config.json and the
	// secrets alone, as in a pod.
	for _, e := range os.Environ() {
		if !strings.HasPrefix(e, "CEPH_CONF=") {
			cmd.Env = append(cmd.Env, e)
		}
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Signal(os.Interrupt)
		cmd.Wait()
		log.Close()
		if t.Failed() {
			b, _ := os.ReadFile(log.Name())
			t.Logf("plugin log:\n%s", tail(string(b), 60))
		}
		{
			// The daemon the node plugin started.
			if b, err := os.ReadFile(filepath.Join(dir, "state", "daemon.lock")); err == nil {
				var pid int
				fmt.Sscan(string(b), &pid)
				if p, err := os.FindProcess(pid); err == nil && pid > 0 {
					p.Signal(os.Interrupt)
				}
			}
		}
	})
	for i := 0; ; i++ {
		if c, err := net.Dial("unix", sock); err == nil {
			c.Close()
			break
		}
		if i > 600 {
			t.Fatalf("the plugin did not listen on %s", sock)
		}
		time.Sleep(100 * time.Millisecond)
	}
	return "unix://" + sock
}

func tail(s string, n int) string {
	lines := strings.Split(s, "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func TestSanity(t *testing.T) {
	c, err := cephtest.Start()
	if err != nil {
		t.Fatal(err)
	}
	if c == nil {
		t.Skip("Ceph not installed")
	}
	defer c.Stop()
	key, err := c.Ceph("auth", "get-key", "client.admin")
	if err != nil {
		t.Fatal(err)
	}
	mons, err := monHost(c.Conf)
	if err != nil {
		t.Fatal(err)
	}
	node := os.Getenv("RBD_NBD_GO_CSI_NODE") == "1"
	dir := t.TempDir()
	endpoint := plugin(t, dir, node, mons, strings.TrimSpace(key))
	secrets := fmt.Sprintf("{userID: admin, userKey: %q}", strings.TrimSpace(key))
	secretsFile := filepath.Join(dir, "secrets.yaml")
	var b strings.Builder
	for _, k := range []string{"CreateVolumeSecret", "DeleteVolumeSecret", "ControllerPublishVolumeSecret",
		"ControllerUnpublishVolumeSecret", "ControllerValidateVolumeCapabilitiesSecret", "NodeStageVolumeSecret",
		"NodePublishVolumeSecret", "ControllerExpandVolumeSecret"} {
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
	}
	suite.Timeout = 40 * time.Minute
	RunSpecs(t, "rbd-nbd-go CSI sanity", suite, reporter)
}
