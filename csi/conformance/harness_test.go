package conformance

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

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
	if cluster.c != nil {
		cluster.c.Stop()
	}
	if dir != "" {
		os.RemoveAll(dir)
	}
	os.Exit(code)
}

// onNode: the node half runs (the VM, with NBD); RBD_NBD_GO_CSI_NODE=1.
func onNode() bool { return os.Getenv("RBD_NBD_GO_CSI_NODE") == "1" }

func needNode(t *testing.T) {
	t.Helper()
	if !onNode() {
		t.Skip("node tests need kernel NBD: they run in the VM (make e2e)")
	}
}

// cluster is the dev cluster, shared by the package's tests.
var cluster struct {
	once      sync.Once
	c         *cephtest.Cluster
	key, mons string
	err       error
}

func needCluster(t *testing.T) *cephtest.Cluster {
	t.Helper()
	cluster.once.Do(func() {
		start := cephtest.Start
		if soakDuration() > 0 {
			start = cephtest.StartBluestore // the soak kills the OSD
		}
		if cluster.c, cluster.err = start(); cluster.err != nil || cluster.c == nil {
			return
		}
		var key string
		if key, cluster.err = cluster.c.Ceph("auth", "get-key", "client.admin"); cluster.err != nil {
			return
		}
		cluster.key = strings.TrimSpace(key)
		cluster.mons, cluster.err = monHost(cluster.c.Conf)
	})
	if cluster.err != nil {
		t.Fatal(cluster.err)
	}
	if cluster.c == nil {
		t.Skip("Ceph not installed")
	}
	return cluster.c
}

func secrets() map[string]string {
	return map[string]string{"userID": "admin", "userKey": cluster.key}
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

// plugin is a running `rbd-nbd-go csi` (both roles) and the node daemon
// it started.
type plugin struct {
	t        *testing.T
	dir, log string
	sock     string
	cmd      *exec.Cmd
	conn     *grpc.ClientConn
	// extra arguments of the csi command, for tests that change flags.
	extra []string
}

func startPlugin(t *testing.T, dir string, extra ...string) *plugin {
	t.Helper()
	needCluster(t)
	conf := filepath.Join(dir, "config.json")
	os.WriteFile(conf, []byte(fmt.Sprintf(`[{"clusterID":"dev","monitors":[%q]}]`, cluster.mons)), 0o600)
	// The controller's own Secret, mounted as files.
	sec := filepath.Join(dir, "controller-secret")
	os.MkdirAll(sec, 0o700)
	os.WriteFile(filepath.Join(sec, "userID"), []byte("admin"), 0o600)
	os.WriteFile(filepath.Join(sec, "userKey"), []byte(cluster.key), 0o600)
	p := &plugin{t: t, dir: dir, sock: filepath.Join(dir, "csi.sock"), log: filepath.Join(dir, "plugin.log"), extra: extra}
	p.start()
	t.Cleanup(func() {
		p.conn.Close()
		p.signal(syscall.SIGTERM)
		if t.Failed() {
			b, _ := os.ReadFile(p.log)
			t.Logf("plugin log:\n%s", tail(string(b), 60))
			b, _ = os.ReadFile(filepath.Join(dir, "state", "daemon.log"))
			t.Logf("daemon log:\n%s", tail(string(b), 30))
		}
	})
	return p
}

// start runs the plugin (again) on the same state directory and waits
// for its socket.
func (p *plugin) start() {
	t := p.t
	// ceph-csi's own arguments (its provisioner's, as the seed's YAML
	// has them), and no --node-registry: ControllerPublish knows the
	// process's own node.
	args := []string{"--state-dir", filepath.Join(p.dir, "state"), "csi",
		"--nodeid=sanity-node", "--type=rbd", "--controllerserver=true", "--endpoint=unix://" + p.sock, "--v=5",
		"--drivername=rbd.csi.ceph.com", "--pidlimit=-1", "--rbdhardmaxclonedepth=8", "--rbdsoftmaxclonedepth=4",
		"--enableprofiling=false",
		"--clusters-config", filepath.Join(p.dir, "config.json"), "--nodeserver",
		"--controller-secret-dir", filepath.Join(p.dir, "controller-secret")}
	args = append(args, p.extra...)
	log, err := os.OpenFile(p.log, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer log.Close()
	p.cmd = exec.Command(binary, args...)
	p.cmd.Stdout, p.cmd.Stderr = log, log
	// No CEPH_CONF: the plugin must work from config.json and the
	// secrets alone, as in a pod.
	for _, e := range os.Environ() {
		if !strings.HasPrefix(e, "CEPH_CONF=") {
			p.cmd.Env = append(p.cmd.Env, e)
		}
	}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	for i := 0; ; i++ {
		if c, err := net.Dial("unix", p.sock); err == nil {
			c.Close()
			break
		}
		if i > 1200 {
			t.Fatalf("the plugin did not listen on %s; its log:\n%s", p.sock, tail(readFile(p.log), 20))
		}
		time.Sleep(100 * time.Millisecond)
	}
	if p.conn, err = grpc.NewClient("unix://"+p.sock, grpc.WithTransportCredentials(insecure.NewCredentials())); err != nil {
		t.Fatal(err)
	}
}

// ready waits until the plugin's Probe says ready: it listens before
// its node daemon is taken over or started, and says ready once that
// daemon serves.
func (p *plugin) ready(timeout time.Duration) error {
	id := csi.NewIdentityClient(p.conn)
	deadline := time.Now().Add(timeout)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		r, err := id.Probe(ctx, &csi.ProbeRequest{})
		cancel()
		if err == nil && r.GetReady().GetValue() {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the plugin's Probe was not ready within %s (last: %v, %v)", timeout, r.GetReady(), err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// daemonPID is the node daemon's pid (its lock file), 0 if none.
func (p *plugin) daemonPID() int {
	b, err := os.ReadFile(filepath.Join(p.dir, "state", "daemon.lock"))
	if err != nil {
		return 0
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	return pid
}

// signal sends sig to every process of the plugin (the plugin and its
// daemon), as a container stop does, and waits for both to exit.
func (p *plugin) signal(sig syscall.Signal) {
	dpid := p.daemonPID()
	p.cmd.Process.Signal(sig)
	if dpid > 0 {
		syscall.Kill(dpid, sig)
	}
	p.cmd.Wait()
	for i := 0; dpid > 0 && i < 300; i++ {
		if syscall.Kill(dpid, 0) != nil {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func tail(s string, n int) string {
	lines := strings.Split(s, "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
