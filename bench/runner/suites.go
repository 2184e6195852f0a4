package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// suite is a set of contenders, the storage they share, and the targets
// the subject (rbd-nbd-go) is held to against the baseline.
type suite struct {
	title    string
	jobsDir  string
	baseline string
	// peer, if set, is another NBD server in front of the same storage,
	// behind the same fio client: the subject is also reported against
	// it, since the baseline may have no NBD hop at all.
	peer     string
	servers  []server
	targets  map[string]target
	setup    func(tmp, size string) ([]string, error) // returns the environment
	teardown func()
}

type target struct {
	MinIOPS float64 `json:"min_iops_ratio"`
	MaxCPU  float64 `json:"max_cpu_ratio,omitempty"` // 0: not a target
}

func newSuite(name, bin string) (*suite, error) {
	switch name {
	case "nbd":
		t := target{MinIOPS: 1.0, MaxCPU: 0.7}
		st := &suite{
			title:    "NBD server vs nbdkit: fio `nbd` engine over a unix socket, 1 GiB memory export",
			jobsDir:  "bench/jobs",
			baseline: "nbdkit-memory",
			servers: []server{
				{"rbd-nbd-go", func(s, sz string) []string { return []string{bin, "serve", "--socket", s, "mem:" + sz} }, nbdFio, true},
				// The same with per-request counters on (a metrics
				// endpoint nobody scrapes): what counting costs.
				{"rbd-nbd-go-metrics", func(s, sz string) []string {
					return []string{bin, "serve", "--metrics-address", "127.0.0.1:0", "--socket", s, "mem:" + sz}
				}, nbdFio, true},
				{"nbdkit-memory", func(s, sz string) []string { return []string{"nbdkit", "-f", "-U", s, "memory", sz} }, nbdFio, true},
				{"nbdkit-null", func(s, sz string) []string { return []string{"nbdkit", "-f", "-U", s, "null", sz} }, nbdFio, true},
			},
			targets:  map[string]target{"randread-4k-qd32": t, "randwrite-4k-qd32": t, "read-1m-qd8": t, "write-1m-qd8": t},
			setup:    func(string, string) ([]string, error) { return os.Environ(), nil },
			teardown: func() {},
		}
		if alt := os.Getenv("BENCH_ALT_BIN"); alt != "" {
			st.servers = append(st.servers, server{"alt", func(s, sz string) []string {
				return []string{alt, "serve", "--socket", s, "mem:" + sz}
			}, nbdFio, true})
		}
		return st, nil
	case "rbd":
		return rbdSuite(bin, os.Getenv("BENCH_ALT_BIN")), nil
	}
	return nil, fmt.Errorf("unknown suite %q (nbd or rbd)", name)
}

// rbdSuite compares, on one dev cluster, fio's rbd engine (librbd direct:
// the ceiling), fio → NBD → rbd-nbd-go → librbd aio, the same over
// go-ceph's synchronous calls, and QEMU's C NBD server on the same librbd
// (the peer). The memstore cluster is recreated for every run: it grows
// with every overwrite. altBin, if set, adds another build of rbd-nbd-go
// (both modes) for an A/B in the same run.
func rbdSuite(bin, altBin string) *suite {
	const image = "rbd/bench"
	var dir string
	st := &suite{
		title:    "RBD: fio `rbd` engine (direct librbd) vs fio `nbd` → rbd-nbd-go → librbd, one-OSD memstore cluster, 1 GiB image",
		jobsDir:  "bench/jobs-rbd",
		baseline: "librbd-direct",
		peer:     "qemu-nbd",
		servers: []server{
			{"librbd-direct", nil, func(string) []string {
				return []string{"--ioengine=rbd", "--pool=rbd", "--rbdname=bench", "--clientname=admin"}
			}, false},
			{"rbd-nbd-go", func(s, _ string) []string { return []string{bin, "serve", "--socket", s, image} }, nbdFio, false},
			{"rbd-nbd-go-metrics", func(s, _ string) []string {
				return []string{bin, "serve", "--metrics-address", "127.0.0.1:0", "--socket", s, image}
			}, nbdFio, false},
			// Zero-copy read replies: safe with fio's libnbd client,
			// which reads with recv; not the default for serve.
			{"rbd-nbd-go-zc", func(s, _ string) []string {
				return []string{bin, "serve", "--zero-copy", "--socket", s, image}
			}, nbdFio, false},
			{"go-ceph-sync", func(s, _ string) []string {
				return []string{bin, "serve", "--socket", s, "rbd-sync:" + image}
			}, nbdFio, false},
			// The C peer on the same librbd: QEMU's NBD server and rbd
			// block driver (qemu-block-extra). --cache=none turns
			// librbd's cache off, as ours is; -t keeps it serving
			// after a client leaves; CEPH_CONF is in its environment.
			// Its writes are the yardstick for the NBD hop, its reads
			// are not: to send holes as holes it asks librbd for block
			// status (rbd_diff_iterate2) before every read once the
			// client negotiates structured replies, as fio's does.
			{"qemu-nbd", func(s, _ string) []string {
				return []string{"qemu-nbd", "-t", "-k", s, "-f", "raw", "--cache=none", "rbd:" + image + ":id=admin"}
			}, nbdFio, false},
		},
		targets: map[string]target{
			"randread-4k-qd32": {MinIOPS: 0.90}, "randwrite-4k-qd32": {MinIOPS: 0.90},
			"read-1m-qd8": {MinIOPS: 0.95}, "write-1m-qd8": {MinIOPS: 0.95},
		},
	}
	if altBin != "" {
		st.servers = append(st.servers,
			server{"alt", func(s, _ string) []string { return []string{altBin, "serve", "--socket", s, image} }, nbdFio, false},
			server{"alt-zc", func(s, _ string) []string {
				return []string{altBin, "serve", "--zero-copy", "--socket", s, image}
			}, nbdFio, false})
	}
	script := filepath.Join("scripts", "ceph-dev-cluster")
	st.setup = func(tmp, size string) ([]string, error) {
		dir = filepath.Join(tmp, "ceph")
		out, err := exec.Command(script, "start", dir).Output()
		if err != nil {
			return nil, fmt.Errorf("dev cluster: %v", err)
		}
		env := append(os.Environ(), "CEPH_CONF="+strings.TrimSpace(string(out)))
		create := exec.Command("rbd", "create", "--size", size, image)
		create.Env = env
		if out, err := create.CombinedOutput(); err != nil {
			return nil, fmt.Errorf("rbd create: %v: %s", err, out)
		}
		// Fill the image once so reads hit real objects.
		fillEnv := append(env, "SIZE="+size)
		if _, _, err := fio(fillEnv, st.servers[0].fio(""), filepath.Join(st.jobsDir, "prefill.fio"), 600); err != nil {
			return nil, fmt.Errorf("prefill: %w", err)
		}
		return env, nil
	}
	st.teardown = func() { exec.Command(script, "stop", dir).Run(); os.RemoveAll(dir) }
	return st
}
