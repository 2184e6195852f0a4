// Package cephtest starts a private single-node Ceph cluster for a test
// package, with the project's scripts/ceph-dev-cluster, and runs rbd/ceph
// commands against it. `make test` sets RBD_NBD_GO_CEPH=required, so a
// machine without Ceph fails there instead of skipping.
package cephtest

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/internal/testcmd"
)

// Cluster is a running dev cluster.
type Cluster struct {
	Dir, Conf string
	script    string
}

// Required reports whether tests must fail rather than skip without Ceph.
func Required() bool { return os.Getenv("RBD_NBD_GO_CEPH") == "required" }

// Start brings a cluster up in a fresh temporary directory. A nil
// cluster with a nil error means Ceph is not installed and not required.
func Start() (*Cluster, error) { return start() }

// StartBluestore is Start with the OSD on bluestore (a sparse file in
// the cluster's directory), for tests that kill the OSD and start it
// again: memstore loses everything with the process.
func StartBluestore() (*Cluster, error) { return start("--bluestore") }

func start(opts ...string) (*Cluster, error) {
	if _, err := exec.LookPath("ceph-osd"); err != nil {
		if Required() {
			return nil, fmt.Errorf("ceph-osd is not installed (make deps installs it)")
		}
		return nil, nil
	}
	root, err := repoRoot()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "rbd-nbd-go-ceph-")
	if err != nil {
		return nil, err
	}
	c := &Cluster{Dir: dir, script: filepath.Join(root, "scripts", "ceph-dev-cluster")}
	out, err := c.run(120*time.Second, c.script, append([]string{"start", dir, "--timeout", "90"}, opts...)...)
	if err != nil {
		return nil, fmt.Errorf("start dev cluster: %v: %s", err, out)
	}
	c.Conf = strings.TrimSpace(out)
	return c, nil
}

// Stop stops the cluster and removes its directory.
func (c *Cluster) Stop() {
	c.run(60*time.Second, c.script, "stop", c.Dir)
	os.RemoveAll(c.Dir)
}

// Rbd runs the rbd tool against the cluster.
func (c *Cluster) Rbd(args ...string) (string, error) {
	return c.run(60*time.Second, "rbd", args...)
}

// Ceph runs the ceph tool against the cluster.
func (c *Cluster) Ceph(args ...string) (string, error) {
	return c.run(60*time.Second, "ceph", args...)
}

// Env is the environment for clients of this cluster.
func (c *Cluster) Env() []string { return append(os.Environ(), "CEPH_CONF="+c.Conf) }

func (c *Cluster) run(timeout time.Duration, name string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	// A daemon the script starts could inherit the output pipes.
	cmd := testcmd.Command(ctx, name, args...)
	if c.Conf != "" {
		cmd.Env = c.Env()
	}
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("%s %s: %v: %s", name, strings.Join(args, " "), err, errb.String())
	}
	return out.String(), nil
}

func repoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", fmt.Errorf("go.mod not found above the test directory")
		}
		dir = parent
	}
}

// OSDPid is the process id of the cluster's OSD.
func (c *Cluster) OSDPid() (int, error) {
	b, err := os.ReadFile(filepath.Join(c.Dir, "run", "osd.pid"))
	if err != nil {
		return 0, err
	}
	var pid int
	_, err = fmt.Sscan(string(b), &pid)
	return pid, err
}

// RestartOSD starts the OSD again after it died, and returns once it
// serves pool rbd.
func (c *Cluster) RestartOSD() error {
	_, err := c.run(150*time.Second, c.script, "restart-osd", c.Dir, "--timeout", "120")
	return err
}
