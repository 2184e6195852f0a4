package interop

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestNbdinfoJSON(t *testing.T) {
	need(t, "nbdinfo")
	for _, tcp := range []bool{false, true} {
		s := serve(t, tcp, "--name", "disk1", "mem:64M")
		var info struct {
			Protocol   string `json:"protocol"`
			Structured bool   `json:"structured"`
			Exports    []struct {
				Name        string   `json:"export-name"`
				Description string   `json:"description"`
				Contexts    []string `json:"contexts"`
				Size        uint64   `json:"export-size"`
				ReadOnly    bool     `json:"is_read_only"`
				MinBlock    uint64   `json:"block_size_minimum"`
				PrefBlock   uint64   `json:"block_size_preferred"`
				MaxBlock    uint64   `json:"block_size_maximum"`
				Caps        map[string]any
			} `json:"exports"`
		}
		out := run(t, "nbdinfo", "--json", s.withExport("disk1"))
		if err := json.Unmarshal([]byte(out), &info); err != nil {
			t.Fatalf("nbdinfo json: %v\n%s", err, out)
		}
		var raw struct{ Exports []map[string]any }
		json.Unmarshal([]byte(out), &raw)
		e := info.Exports[0]
		if info.Protocol != "newstyle-fixed" || !info.Structured || e.Name != "disk1" ||
			e.Size != 64<<20 || e.ReadOnly || e.Description != "memory 64M" {
			t.Fatalf("nbdinfo: %s", out)
		}
		if e.MinBlock != 1 || e.PrefBlock != 4096 || e.MaxBlock != 32<<20 {
			t.Fatalf("block sizes %d/%d/%d", e.MinBlock, e.PrefBlock, e.MaxBlock)
		}
		if len(e.Contexts) != 1 || e.Contexts[0] != "base:allocation" {
			t.Fatalf("contexts %v", e.Contexts)
		}
		for _, c := range []string{"can_cache", "can_df", "can_fast_zero", "can_flush", "can_fua",
			"can_multi_conn", "can_trim", "can_zero"} {
			if raw.Exports[0][c] != true {
				t.Errorf("tcp=%v: %s = %v", tcp, c, raw.Exports[0][c])
			}
		}
		if list := run(t, "nbdinfo", "--list", s.withExport("")); !strings.Contains(list, "disk1") {
			t.Fatalf("nbdinfo --list: %s", list)
		}
	}
}

func TestReadOnlyExport(t *testing.T) {
	need(t, "nbdinfo", "nbdsh")
	s := serve(t, false, "--read-only", "mem:1M")
	out := run(t, "nbdinfo", "--json", s.uri)
	if !strings.Contains(out, `"is_read_only": true`) {
		t.Fatalf("read-only not advertised: %s", out)
	}
	// With strict mode off libnbd sends the write; the server must say EPERM.
	run(t, "nbdsh", "-u", s.uri, "-c", `
import errno
h.set_strict_mode(0)
try:
    h.pwrite(b"x" * 512, 0)
    raise SystemExit("write to a read-only export succeeded")
except nbd.Error as e:
    assert e.errnum == errno.EPERM, e
assert h.pread(512, 0) == bytes(512)
`)
}

func TestNbdshAllCommands(t *testing.T) {
	need(t, "nbdsh")
	s := serve(t, false, "mem:64M")
	run(t, "nbdsh", "--base-allocation", "-u", s.uri, "-c", `
import os, errno
assert h.get_size() == 64 << 20
for cap in ("can_flush", "can_fua", "can_trim", "can_zero", "can_fast_zero",
            "can_cache", "can_df", "can_multi_conn", "can_meta_context"):
    f = getattr(h, cap)
    assert (f("base:allocation") if cap == "can_meta_context" else f()), cap
buf = os.urandom(1 << 20)
h.pwrite(buf, 4096, nbd.CMD_FLAG_FUA)
assert h.pread(1 << 20, 4096) == buf
chunks = []
def chunk(sub, off, status, err):
    chunks.append((bytes(sub), off, status))
    return 0
h.pread_structured(65536, 4096, chunk, nbd.CMD_FLAG_DF)
assert len(chunks) == 1 and chunks[0] == (buf[:65536], 4096, nbd.READ_DATA), len(chunks)
h.flush()
h.zero(8192, 65536, nbd.CMD_FLAG_NO_HOLE)
h.zero(4096, 200000, nbd.CMD_FLAG_FAST_ZERO)
assert h.pread(4096, 200000) == bytes(4096)
assert h.pread(8192, 65536) == bytes(8192)
h.trim(1 << 20, 1 << 20)
h.cache(1 << 20, 0)
ents = []
def cb(meta, off, e, err):
    assert meta == "base:allocation"
    ents.extend(e)
    return 0
h.block_status(2 << 20, 0, cb)
# [0,1M) written, [1M,2M) trimmed back to a hole
assert ents == [1 << 20, 0, 1 << 20, 3], ents
ents.clear()
h.block_status(2 << 20, 0, cb, nbd.CMD_FLAG_REQ_ONE)
assert ents == [1 << 20, 0], ents
# Requests a strict client would refuse reach the server, get errors,
# and leave the connection usable.
h.set_strict_mode(0)
for off, n, want in ((h.get_size() - 512, 1024, errno.EINVAL), (0, (32 << 20) + 1, errno.EOVERFLOW)):
    try:
        h.pread(n, off)
        raise SystemExit("bad read accepted")
    except nbd.Error as e:
        assert e.errnum == want, (e, want)
try:
    h.pwrite(b"x" * 1024, h.get_size() - 512)
    raise SystemExit("write beyond the end accepted")
except nbd.Error as e:
    assert e.errnum == errno.ENOSPC, e
assert h.pread(4096, 1 << 19) == buf[(1 << 19) - 4096:(1 << 19)]
`)
}

func TestNbdcopyRoundTrip(t *testing.T) {
	need(t, "nbdcopy")
	const size = 48 << 20
	src, sum := randomFile(t, size)
	for _, spec := range []string{fmt.Sprintf("mem:%d", size), "file"} {
		if spec == "file" {
			dst := filepath.Join(t.TempDir(), "backing")
			run(t, "truncate", "-s", fmt.Sprint(size), dst)
			spec = "file:" + dst
		}
		for _, conns := range []string{"1", "4"} {
			s := serve(t, false, spec)
			run(t, "nbdcopy", "--connections="+conns, "--flush", src, s.uri)
			back := filepath.Join(t.TempDir(), "back")
			run(t, "nbdcopy", "--connections="+conns, s.uri, back)
			if fileSum(t, back) != sum {
				t.Fatalf("%s, %s connections: data differs after round trip", spec, conns)
			}
		}
	}
}

func TestQemuIOAndImg(t *testing.T) {
	need(t, "qemu-io", "qemu-img")
	const size = 16 << 20
	s := serve(t, false, fmt.Sprintf("mem:%d", size))
	out := run(t, "qemu-io", "-f", "raw", s.uri,
		"-c", "write -P 0xab 0 1M",
		"-c", "read -P 0xab 0 1M",
		"-c", "aio_write -P 0xcd 2M 1M",
		"-c", "aio_write -P 0xce 3M 1M",
		"-c", "aio_flush",
		"-c", "read -P 0xcd 2M 1M",
		"-c", "read -P 0xce 3M 1M",
		"-c", "discard 0 64k",
		"-c", "write -z 64k 64k",
		"-c", "read -P 0 64k 64k",
		"-c", "write -z -u 1M 128k",
		"-c", "read -P 0 1M 128k",
		"-c", "write -f -P 0x11 4M 4k",
		"-c", "read -P 0x11 4M 4k")
	if strings.Contains(out, "fail") || strings.Count(out, "read ") != 6 {
		t.Fatalf("qemu-io: %s", out)
	}
	src, _ := randomFile(t, size)
	run(t, "qemu-img", "convert", "-n", "-f", "raw", "-O", "raw", src, s.uri)
	run(t, "qemu-img", "compare", "-f", "raw", "-F", "raw", src, s.uri)
	// compare must be able to fail: change one byte and expect exit 1.
	run(t, "qemu-io", "-f", "raw", s.uri, "-c", "write -P 0x5a 12345 1")
	if err := client(t, time.Minute, "qemu-img", "compare", "-q", "-f", "raw", "-F", "raw", src, s.uri).Run(); err == nil {
		t.Fatal("qemu-img compare saw no difference after a write")
	}
}

func TestFioVerify(t *testing.T) {
	need(t, "fio")
	for _, tc := range []struct {
		tcp   bool
		flags []string
	}{{false, nil}, {true, nil}, {false, []string{"--zero-copy"}}} {
		// --zero-copy: libnbd reads with recv, so 64 KiB+ reads may be
		// spliced; verify reads them back through that path.
		tcp := tc.tcp
		s := serve(t, tcp, append(tc.flags, "mem:256M")...)
		for _, job := range [][]string{
			{"--rw=randwrite", "--bs=4k", "--iodepth=32", "--size=64M"},
			{"--rw=write", "--bs=1M", "--iodepth=8", "--size=128M"},
			{"--rw=randwrite", "--bs=64k", "--iodepth=16", "--size=32M", "--numjobs=2", "--offset_increment=64M"},
		} {
			args := append([]string{"--name=verify", "--ioengine=nbd", "--uri=" + s.uri,
				"--verify=crc32c", "--do_verify=1", "--verify_fatal=1", "--output-format=json"}, job...)
			for _, j := range fioJobs(t, run(t, "fio", args...)) {
				if j.Error != 0 || j.Write.IOBytes == 0 || j.Read.IOBytes != j.Write.IOBytes {
					t.Fatalf("tcp=%v %v %v: error %d, wrote %d, verified %d", tcp, tc.flags, job, j.Error, j.Write.IOBytes, j.Read.IOBytes)
				}
			}
		}
	}
}

func TestSocketActivation(t *testing.T) {
	need(t, "nbdinfo")
	out := run(t, "nbdinfo", "--size", "--", "[", binary, "serve", "mem:3M", "]")
	if strings.TrimSpace(out) != fmt.Sprint(3<<20) {
		t.Fatalf("size via socket activation: %q", out)
	}
}

type fioJob struct {
	Error int `json:"error"`
	Write struct {
		IOBytes int64 `json:"io_bytes"`
		Clat    struct {
			Max float64 `json:"max"`
		} `json:"clat_ns"`
	} `json:"write"`
	Read struct {
		IOBytes int64 `json:"io_bytes"`
	} `json:"read"`
}

// fioJobs parses fio's JSON output (the nbd engine prints a line first).
func fioJobs(t *testing.T, out string) []fioJob {
	t.Helper()
	if i := strings.IndexByte(out, '{'); i >= 0 {
		out = out[i:]
	}
	var res struct{ Jobs []fioJob }
	if err := json.Unmarshal([]byte(out), &res); err != nil || len(res.Jobs) == 0 {
		t.Fatalf("fio json: %v", err)
	}
	return res.Jobs
}

// TestBlockDevice serves a real block device (a loop device): size from
// the device, fio verify, write-zeroes and discard through fallocate on
// the device, and the bytes land on the device itself.
func TestBlockDevice(t *testing.T) {
	need(t, "losetup", "fio", "qemu-io")
	img := filepath.Join(t.TempDir(), "backing")
	run(t, "truncate", "-s", "64M", img)
	cmd := client(t, time.Minute, "losetup", "-f", "--show", img)
	out, err := cmd.Output()
	if err != nil {
		t.Skipf("no loop device here: %v", err)
	}
	dev := strings.TrimSpace(string(out))
	t.Cleanup(func() { exec.Command("losetup", "-d", dev).Run() })
	s := serve(t, false, "file:"+dev)
	if size := strings.TrimSpace(run(t, "nbdinfo", "--size", s.uri)); size != fmt.Sprint(64<<20) {
		t.Fatalf("block device size %s", size)
	}
	run(t, "fio", "--name=bd", "--ioengine=nbd", "--uri="+s.uri, "--rw=randwrite", "--bs=4k",
		"--iodepth=16", "--size=16M", "--verify=crc32c", "--do_verify=1", "--verify_fatal=1")
	qio := run(t, "qemu-io", "-f", "raw", s.uri, "-c", "write -P 0x77 32M 1M", "-c", "write -z 32M 64k",
		"-c", "discard 33M 4k", "-c", "flush", "-c", "read -P 0 32M 64k", "-c", "read -P 0x77 32832k 64k")
	if strings.Contains(qio, "fail") {
		t.Fatalf("qemu-io on a block device: %s", qio)
	}
	b, err := os.ReadFile(img) // loop devices write through to the file
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(b[32<<20:32<<20+65536], make([]byte, 65536)) ||
		!bytes.Equal(b[32<<20+65536:32<<20+131072], bytes.Repeat([]byte{0x77}, 65536)) {
		t.Fatal("device contents differ from what was written")
	}
}
