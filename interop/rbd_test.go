package interop

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/internal/cephtest"
)

var imageSeq int

func newRBDImage(t *testing.T, c *cephtest.Cluster, size string) string {
	t.Helper()
	imageSeq++
	name := fmt.Sprintf("rbd/it%d-%d", os.Getpid(), imageSeq)
	if _, err := c.Rbd("create", "--size", size, name); err != nil {
		t.Fatal(err)
	}
	return name
}

func rbdExport(t *testing.T, c *cephtest.Cluster, spec string) []byte {
	t.Helper()
	p := filepath.Join(t.TempDir(), "export")
	if _, err := c.Rbd("export", spec, p); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestRBDDataPath: what fio, qemu-io and nbdcopy write through NBD is what
// `rbd export` reads back, and what nbdcopy reads through NBD (in 256 KiB
// requests: lent from librbd's buffers, spliced with --zero-copy) is what
// `rbd export` holds, holes included; over unix, TCP and zero-copy unix.
func TestRBDDataPath(t *testing.T) {
	need(t, "fio", "qemu-io", "nbdcopy")
	c := needCeph(t)
	for _, tc := range []struct {
		tcp   bool
		flags []string
	}{{false, nil}, {true, nil}, {false, []string{"--zero-copy"}}} {
		img := newRBDImage(t, c, "128M")
		s := serveEnv(t, c.Env(), tc.tcp, append(tc.flags, img)...)
		for _, job := range [][]string{
			{"--rw=randwrite", "--bs=4k", "--iodepth=32", "--size=16M"},
			{"--rw=write", "--bs=1M", "--iodepth=8", "--size=64M"},
		} {
			args := append([]string{"--name=verify", "--ioengine=nbd", "--uri=" + s.uri,
				"--verify=crc32c", "--do_verify=1", "--verify_fatal=1"}, job...)
			run(t, "fio", args...)
		}
		run(t, "qemu-io", "-f", "raw", s.uri,
			"-c", "write -P 0xa1 100M 1M", "-c", "write -f -P 0xb2 102M 64k",
			"-c", "write -z 101M 64k", "-c", "discard 103M 4M", "-c", "flush")
		src, _ := randomFile(t, 8<<20)
		run(t, "nbdcopy", "--flush", src, s.uri)
		exp := rbdExport(t, c, img)
		want, _ := os.ReadFile(src)
		if !bytes.Equal(exp[:8<<20], want) {
			t.Fatal("nbdcopy data differs in rbd export")
		}
		if !bytes.Equal(exp[100<<20:101<<20], bytes.Repeat([]byte{0xa1}, 1<<20)) ||
			!bytes.Equal(exp[101<<20:101<<20+65536], make([]byte, 65536)) ||
			!bytes.Equal(exp[102<<20:102<<20+65536], bytes.Repeat([]byte{0xb2}, 65536)) ||
			!bytes.Equal(exp[103<<20:107<<20], make([]byte, 4<<20)) {
			t.Fatal("qemu-io patterns differ in rbd export")
		}
		back := filepath.Join(t.TempDir(), "back.raw")
		run(t, "nbdcopy", s.uri, back)
		got, _ := os.ReadFile(back)
		if !bytes.Equal(got, exp) {
			t.Fatal("what nbdcopy reads through NBD differs from rbd export")
		}
	}
}

// TestRBDDurabilityKill9: data acknowledged for a FLUSH, or a FUA write,
// is in the cluster even when the server dies right after the reply.
func TestRBDDurabilityKill9(t *testing.T) {
	need(t, "nbdsh")
	c := needCeph(t)
	img := newRBDImage(t, c, "32M")
	s := serveEnv(t, c.Env(), false, img)
	script := `
import os, signal
h.pwrite(b"\x5a" * 1048576, 0)
h.pwrite(b"\x3c" * 65536, 4194304)
h.flush()
h.pwrite(b"\x6b" * 65536, 8388608, nbd.CMD_FLAG_FUA)
os.kill(int(os.environ["SERVER_PID"]), signal.SIGKILL)
`
	runEnv(t, []string{fmt.Sprintf("SERVER_PID=%d", s.cmd.Process.Pid)}, "nbdsh", "-u", s.uri, "-c", script)
	s.cmd.Wait()
	exp := rbdExport(t, c, img)
	if !bytes.Equal(exp[:1<<20], bytes.Repeat([]byte{0x5a}, 1<<20)) ||
		!bytes.Equal(exp[4<<20:4<<20+65536], bytes.Repeat([]byte{0x3c}, 65536)) {
		t.Fatal("data acknowledged by FLUSH lost after kill -9")
	}
	if !bytes.Equal(exp[8<<20:8<<20+65536], bytes.Repeat([]byte{0x6b}, 65536)) {
		t.Fatal("FUA write lost after kill -9")
	}
}

func TestRBDReadOnlySnapshotExclusive(t *testing.T) {
	need(t, "nbdsh")
	c := needCeph(t)
	img := newRBDImage(t, c, "8M")
	if _, err := c.Rbd("snap", "create", img+"@s1"); err != nil {
		t.Fatal(err)
	}
	check := `
import errno
h.set_strict_mode(0)
assert h.is_read_only()
try:
    h.pwrite(b"x" * 512, 0)
    raise SystemExit("write accepted")
except nbd.Error as e:
    assert e.errnum == errno.EPERM, e
h.pread(4096, 0)
`
	for _, args := range [][]string{{"--read-only", img}, {img + "@s1"}} {
		s := serveEnv(t, c.Env(), false, args...)
		run(t, "nbdsh", "-u", s.uri, "-c", check)
	}
	// --exclusive: a second holder fails in one clear line.
	serveEnv(t, c.Env(), false, "--exclusive", img)
	cmd := client(t, time.Minute, binary, "serve", "--socket", filepath.Join(t.TempDir(), "s"), "--exclusive", img)
	cmd.Env = c.Env()
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err == nil || !strings.Contains(stderr.String(), "held by another client") ||
		strings.Count(stderr.String(), "\n") != 1 {
		t.Fatalf("second --exclusive: %v %q", err, stderr.String())
	}
}

// TestRBDResize: a new connection sees the new size; one already open
// keeps working with the size it negotiated.
func TestRBDResize(t *testing.T) {
	need(t, "nbdsh", "nbdinfo")
	c := needCeph(t)
	img := newRBDImage(t, c, "8M")
	s := serveEnv(t, c.Env(), false, img)
	flag := filepath.Join(t.TempDir(), "resized")
	old := client(t, 2*time.Minute, "nbdsh", "-u", s.uri, "-c", fmt.Sprintf(`
import os, time
assert h.get_size() == 8 << 20
open(%[1]q + ".ready", "w").close()
while not os.path.exists(%[1]q):
    time.sleep(0.05)
h.pwrite(b"r" * 4096, 4 << 20)
assert h.pread(4096, 4 << 20) == b"r" * 4096
assert h.get_size() == 8 << 20
`, flag))
	old.Env = append(os.Environ(), "PATH=/usr/bin:"+os.Getenv("PATH"))
	var oldOut bytes.Buffer
	old.Stdout, old.Stderr = &oldOut, &oldOut
	if err := old.Start(); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if _, err := os.Stat(flag + ".ready"); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("old connection never came up: %s", oldOut.String())
		}
	}
	if _, err := c.Rbd("resize", "--size", "24M", img); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if strings.TrimSpace(run(t, "nbdinfo", "--size", s.uri)) == fmt.Sprint(24<<20) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("new connections still see the old size")
		}
	}
	os.WriteFile(flag, nil, 0o600)
	if err := old.Wait(); err != nil {
		t.Fatalf("old connection after resize: %v: %s", err, oldOut.String())
	}
}

// TestRBDBadInput: one clear line, non-zero exit, within the timeout.
func TestRBDBadInput(t *testing.T) {
	c := needCeph(t)
	img := newRBDImage(t, c, "8M")
	badKeyring := filepath.Join(t.TempDir(), "keyring")
	os.WriteFile(badKeyring, []byte("[client.admin]\n\tkey = AQBvaBFZAAAAABAAAAAAAAAAAAAAAAAAAAAAAA==\n"), 0o600)
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"nopool/x"}, `pool "nopool" does not exist`},
		{[]string{"rbd/nope"}, "image rbd/nope does not exist"},
		{[]string{"--keyring", badKeyring, "--op-timeout", "5s", img}, "permission denied"},
		{[]string{"-m", "127.0.0.1:1", "-c", "/dev/null", "--keyring", badKeyring, "--op-timeout", "3s", img}, "no monitor answered"},
	}
	for _, tc := range cases {
		args := append([]string{"serve", "--socket", filepath.Join(t.TempDir(), "s")}, tc.args...)
		cmd := client(t, time.Minute, binary, args...)
		cmd.Env = c.Env()
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		start := time.Now()
		err := cmd.Run()
		timedOut := time.Since(start) >= time.Minute
		msg := stderr.String()
		if err == nil || timedOut || strings.Count(msg, "\n") != 1 || !strings.Contains(msg, tc.want) {
			t.Errorf("%v: %v, stderr %q; want one line with %q", tc.args, err, msg, tc.want)
		}
		if strings.Contains(msg, "AQBvaBFZ") {
			t.Errorf("%v: key leaked into stderr", tc.args)
		}
	}
}

// TestRBDOSDOutage: the only OSD stops answering for 10 s in the middle of
// a verified write run. Requests wait and then complete: no I/O error, no
// verify error. The run is bounded; it fails rather than hangs.
func TestRBDOSDOutage(t *testing.T) {
	need(t, "fio")
	c := needCeph(t)
	img := newRBDImage(t, c, "64M")
	s := serveEnv(t, c.Env(), false, img)
	pid, err := c.OSDPid()
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		time.Sleep(2 * time.Second)
		syscall.Kill(pid, syscall.SIGSTOP)
		time.Sleep(10 * time.Second)
		syscall.Kill(pid, syscall.SIGCONT)
	}()
	t.Cleanup(func() { syscall.Kill(pid, syscall.SIGCONT) })
	out := run(t, "fio", "--name=outage", "--ioengine=nbd", "--uri="+s.uri, "--rw=randwrite", "--bs=4k",
		"--iodepth=16", "--size=32M", "--rate_iops=1500", "--verify=crc32c", "--do_verify=1",
		"--verify_fatal=1", "--output-format=json")
	j := fioJobs(t, out)[0]
	if j.Error != 0 || j.Write.IOBytes != 32<<20 || j.Read.IOBytes != 32<<20 {
		t.Fatalf("error %d, wrote %d, verified %d", j.Error, j.Write.IOBytes, j.Read.IOBytes)
	}
	if j.Write.Clat.Max < 5e9 {
		t.Fatalf("longest write took %.1fs: the outage did not hit the run", j.Write.Clat.Max/1e9)
	}
	t.Logf("longest write waited %.1fs through the outage", j.Write.Clat.Max/1e9)
}
