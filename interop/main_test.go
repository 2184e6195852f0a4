// Package interop tests rbd-nbd-go against real third-party NBD clients
// (libnbd's nbdinfo/nbdcopy/nbdsh, qemu-io/qemu-img, fio's nbd engine).
// `make test` sets RBD_NBD_GO_INTEROP=required, so a missing client is a
// failure there; a bare `go test ./...` skips instead.
package interop

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/internal/cephtest"
	"github.com/rbd-nbd-go/rbd-nbd-go/internal/testcmd"
)

var binary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "rbd-nbd-go-interop-")
	if err != nil {
		panic(err)
	}
	binary = filepath.Join(dir, "rbd-nbd-go")
	build := exec.Command("go", "build", "-o", binary, "../cmd/rbd-nbd-go")
	build.Stderr = os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "building rbd-nbd-go:", err)
		os.Exit(1)
	}
	code := m.Run()
	if ceph.c != nil {
		ceph.c.Stop()
	}
	os.RemoveAll(dir)
	os.Exit(code)
}

// need skips (or, under make test, fails) when a client is missing.
func need(t *testing.T, tools ...string) {
	t.Helper()
	for _, tool := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			if os.Getenv("RBD_NBD_GO_INTEROP") == "required" {
				t.Fatalf("%s is not installed (make deps installs it)", tool)
			}
			t.Skipf("%s not installed", tool)
		}
	}
}

// ceph is the dev cluster, started by the first test that needs it.
var ceph struct {
	once sync.Once
	c    *cephtest.Cluster
	err  error
}

func needCeph(t *testing.T) *cephtest.Cluster {
	t.Helper()
	ceph.once.Do(func() { ceph.c, ceph.err = cephtest.Start() })
	if ceph.err != nil {
		t.Fatal(ceph.err)
	}
	if ceph.c == nil {
		t.Skip("Ceph not installed")
	}
	return ceph.c
}

// server is a running `rbd-nbd-go serve`.
type server struct {
	cmd    *exec.Cmd
	uri    string
	socket string
	addr   string
	stderr *bytes.Buffer
}

// serve starts the binary on a unix socket (or TCP with tcp=true) and
// waits until it accepts connections.
func serve(t *testing.T, tcp bool, args ...string) *server {
	t.Helper()
	return serveEnv(t, nil, tcp, args...)
}

// serveEnv is serve with a different environment (nil: inherit).
func serveEnv(t *testing.T, env []string, tcp bool, args ...string) *server {
	t.Helper()
	s := &server{stderr: &bytes.Buffer{}}
	if tcp {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		s.addr = l.Addr().String()
		l.Close()
		args = append([]string{"serve", "--listen", s.addr}, args...)
		s.uri = "nbd://" + s.addr + "/"
	} else {
		s.socket = filepath.Join(t.TempDir(), "nbd.sock")
		args = append([]string{"serve", "--socket", s.socket}, args...)
		s.uri = "nbd+unix:///?socket=" + s.socket
	}
	s.cmd = exec.Command(binary, args...)
	s.cmd.Env = env
	s.cmd.Stderr = s.stderr
	if err := s.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.stop(t) })
	deadline := time.Now().Add(10 * time.Second)
	for {
		network, addr := "unix", s.socket
		if tcp {
			network, addr = "tcp", s.addr
		}
		if c, err := net.Dial(network, addr); err == nil {
			c.Close()
			return s
		}
		if time.Now().After(deadline) || s.exited() {
			t.Fatalf("server did not come up: %s", s.stderr)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// withExport points the URI at a named export.
func (s *server) withExport(name string) string {
	if s.socket != "" {
		return "nbd+unix:///" + name + "?socket=" + s.socket
	}
	return "nbd://" + s.addr + "/" + name
}

func (s *server) exited() bool {
	return s.cmd.ProcessState != nil || s.cmd.Process.Signal(syscall.Signal(0)) != nil
}

// kill9 kills the server the hard way: no shutdown, no final flush.
func (s *server) kill9() {
	s.cmd.Process.Kill()
	s.cmd.Wait()
}

// stop sends SIGTERM and requires a clean exit: graceful shutdown is
// part of what is tested every time.
func (s *server) stop(t *testing.T) {
	if s.cmd.ProcessState != nil {
		return
	}
	s.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan error, 1)
	go func() { done <- s.cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("server exit: %v\n%s", err, s.stderr)
		}
	case <-time.After(30 * time.Second):
		s.cmd.Process.Kill()
		t.Errorf("server ignored SIGTERM for 30s\n%s", s.stderr)
	}
	if s.socket != "" {
		if _, err := os.Stat(s.socket); err == nil {
			t.Errorf("socket %s left behind", s.socket)
		}
	}
}

// run executes a client and returns its stdout, failing on a non-zero exit.
func run(t *testing.T, name string, args ...string) string {
	t.Helper()
	return runEnv(t, nil, name, args...)
}

// runEnv is run with an extra environment.
func runEnv(t *testing.T, env []string, name string, args ...string) string {
	t.Helper()
	cmd := client(t, 3*time.Minute, name, args...)
	// Files a client leaves behind (fio's verify state) go with the test.
	cmd.Dir = t.TempDir()
	// nbdsh and friends must find Debian's python3 with the nbd module.
	cmd.Env = append(append(os.Environ(), "PATH=/usr/bin:"+os.Getenv("PATH")), env...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		t.Fatalf("%s %s: %v\nstdout: %s\nstderr: %s", name, strings.Join(args, " "), err, out.String(), errb.String())
	}
	return out.String()
}

// client is a command that cannot outlive its bound or its test.
func client(t *testing.T, bound time.Duration, name string, args ...string) *exec.Cmd {
	ctx, cancel := context.WithTimeout(context.Background(), bound)
	t.Cleanup(cancel)
	return testcmd.Command(ctx, name, args...)
}

func randomFile(t *testing.T, size int) (string, [32]byte) {
	t.Helper()
	b := make([]byte, size)
	rand.Read(b)
	// Leave some all-zero stretches so sparse handling is exercised.
	for i := 0; i+65536 <= size; i += 1 << 20 {
		clear(b[i : i+65536])
	}
	p := filepath.Join(t.TempDir(), "data")
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return p, sha256.Sum256(b)
}

func fileSum(t *testing.T, p string) [32]byte {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return sha256.Sum256(b)
}
