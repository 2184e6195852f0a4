// Command runner runs the fio job files in bench/jobs against several NBD
// servers in one run, rotating their order each round so drift on a
// noisy machine hits all of them alike, and reports IOPS, throughput, p99
// latency and server CPU time per I/O, with ratios against a baseline.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// server is one contender: an optional server process (argv, given the
// socket path and export size) and the fio engine options that reach it.
type server struct {
	Name string
	argv func(sock, size string) []string // nil: fio talks to the storage itself
	fio  func(sock string) []string
	// empty: the export starts empty (a memory export), so read jobs
	// prefill it first; RBD images are filled by the suite's setup,
	// which runs before every job of every contender.
	empty bool
}

func nbdFio(sock string) []string {
	return []string{"--ioengine=nbd", "--uri=nbd+unix:///?socket=" + sock}
}

type sample struct {
	Server     string  `json:"server"`
	Job        string  `json:"job"`
	Round      int     `json:"round"`
	IOPS       float64 `json:"iops"`
	MiBps      float64 `json:"mib_s"`
	P99us      float64 `json:"p99_us"`
	CPUusPerIO float64 `json:"server_cpu_us_per_io"`
	// fio's own CPU per I/O: the client, and for direct librbd all of
	// librbd's work too, so client+server compares every contender.
	ClientCPUusPerIO float64 `json:"client_cpu_us_per_io"`
	IOs              int64   `json:"ios"`
	CPUSec           float64 `json:"server_cpu_s"`
	// The whole box's CPU per I/O (fio, server, OSD, monitor, the
	// kernel's softirqs) and how busy its CPUs were: when they are all
	// busy, IOPS can only rise as this falls, whichever process pays.
	BoxCPUusPerIO float64 `json:"box_cpu_us_per_io"`
	BoxBusy       float64 `json:"box_busy"`
}

func main() {
	bin := flag.String("bin", "bin/rbd-nbd-go", "rbd-nbd-go binary")
	jobsDir := flag.String("jobs", "", "fio job files (default: the suite's)")
	out := flag.String("out", "bench/results", "output directory")
	runtime := flag.Int("runtime", envInt("BENCH_RUNTIME", 10), "seconds per job")
	rounds := flag.Int("rounds", envInt("BENCH_ROUNDS", 2), "rounds (server order rotates)")
	size := flag.String("size", "1G", "export size")
	only := flag.String("only", os.Getenv("BENCH_JOBS"), "comma-separated job names (default all)")
	pick := flag.String("servers", os.Getenv("BENCH_SERVERS"), "comma-separated contenders (default all; the baseline always runs)")
	rerender := flag.String("report", "", "re-render the report from this results.json instead of running")
	suiteName := flag.String("suite", "nbd", "nbd: against nbdkit on memory; rbd: against direct librbd on a dev Ceph cluster")
	flag.Parse()

	st, err := newSuite(*suiteName, *bin)
	if err != nil {
		log.Fatal(err)
	}
	if *jobsDir == "" {
		*jobsDir = st.jobsDir
	}
	servers, err := pickServers(st.servers, st.baseline, *pick)
	if err != nil {
		log.Fatal(err)
	}
	jobs, err := listJobs(*jobsDir, *only)
	if err != nil {
		log.Fatal(err)
	}
	if err := os.MkdirAll(*out, 0o755); err != nil {
		log.Fatal(err)
	}
	tmp, err := os.MkdirTemp("", "nbd-bench-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(tmp)

	var samples []sample
	if *rerender != "" {
		var saved struct {
			Runtime int      `json:"runtime_s"`
			Rounds  int      `json:"rounds"`
			Samples []sample `json:"samples"`
		}
		b, err := os.ReadFile(*rerender)
		if err == nil {
			err = json.Unmarshal(b, &saved)
		}
		if err != nil {
			log.Fatal(err)
		}
		samples, *runtime, *rounds = saved.Samples, saved.Runtime, saved.Rounds
		*rounds = 0 // nothing to run
	}
	// Progress: runs done of all, and the time left at the pace so far.
	total, done, t0 := *rounds*len(jobs)*len(servers), 0, time.Now()
	if total > 0 {
		log.Printf("%s suite: %d jobs x %d servers x %d rounds = %d runs of %d s (about %s with set-up)",
			*suiteName, len(jobs), len(servers), *rounds, total, *runtime,
			(time.Duration(total*(*runtime+3)) * time.Second).Round(time.Minute))
	}
	for round := 1; round <= *rounds; round++ {
		for _, job := range jobs {
			// Rotate: over len(servers) rounds each server runs in
			// each position once, so drift on the box falls on every
			// server alike.
			k := (round - 1) % len(servers)
			order := append(slices.Clone(servers[k:]), servers[:k]...)
			for _, srv := range order {
				// Fresh storage for every run: a memstore OSD grows
				// with every overwrite, and a write job that ran
				// third in a round cost the whole box 20-40 % more
				// per I/O than the same job run first.
				env, err := st.setup(tmp, *size)
				if err != nil {
					log.Fatalf("round %d setup: %v", round, err)
				}
				s, err := runOne(tmp, env, *jobsDir, job, srv, *size, *runtime)
				st.teardown()
				if err != nil {
					log.Fatalf("%s on %s: %v", job, srv.Name, err)
				}
				s.Round = round
				done++
				left := time.Since(t0) / time.Duration(done) * time.Duration(total-done)
				log.Printf("[%d/%d, %s left] round %d %-22s %-14s %9.0f IOPS %8.1f MiB/s p99 %7.0f µs cpu %6.2f µs/IO",
					done, total, left.Round(time.Second), round, job, srv.Name, s.IOPS, s.MiBps, s.P99us, s.CPUusPerIO)
				samples = append(samples, s)
			}
		}
	}
	rep := summarize(samples, jobs, servers, st.baseline, "rbd-nbd-go")
	rep.Targets = st.targets
	rep.addPeer(samples, st.peer)
	write := func(name string, b []byte) {
		if err := os.WriteFile(filepath.Join(*out, name), b, 0o644); err != nil {
			log.Fatal(err)
		}
	}
	if *rerender != "" {
		*rounds = len(samples) / max(1, len(jobs)*len(servers))
	}
	js, _ := json.MarshalIndent(map[string]any{"runtime_s": *runtime, "rounds": *rounds,
		"size": *size, "samples": samples, "summary": rep}, "", "  ")
	write("results.json", js)
	md := markdown(rep, st.title, *runtime, *rounds)
	write("results.md", []byte(md))
	write("chart.svg", []byte(chart(rep)))
	fmt.Print(md)
}

func envInt(k string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(k)); err == nil && v > 0 {
		return v
	}
	return def
}

func listJobs(dir, only string) ([]string, error) {
	files, err := filepath.Glob(filepath.Join(dir, "*.fio"))
	if err != nil {
		return nil, err
	}
	want := map[string]bool{}
	for _, j := range strings.Split(only, ",") {
		if j != "" {
			want[j] = true
		}
	}
	var jobs []string
	for _, f := range files {
		name := strings.TrimSuffix(filepath.Base(f), ".fio")
		if name != "prefill" && (len(want) == 0 || want[name]) {
			jobs = append(jobs, name)
		}
	}
	// Stable, readable order: by block size, then queue depth.
	order := []string{"randread-4k-qd1", "randread-4k-qd32", "randread-4k-qd32-nj2",
		"randwrite-4k-qd32", "read-1m-qd8", "write-1m-qd8"}
	slices.SortFunc(jobs, func(a, b string) int {
		ia, ib := slices.Index(order, a), slices.Index(order, b)
		if ia < 0 || ib < 0 {
			return strings.Compare(a, b)
		}
		return ia - ib
	})
	if len(jobs) == 0 {
		return nil, fmt.Errorf("no jobs in %s match %q", dir, only)
	}
	return jobs, nil
}

// runOne starts srv, prefills for read jobs, runs the job, and reads the
// server's CPU time from /proc around the job only.
func runOne(tmp string, env []string, jobsDir, job string, srv server, size string, runtime int) (sample, error) {
	sock := filepath.Join(tmp, srv.Name+".sock")
	os.Remove(sock)
	pid := 0
	if srv.argv != nil {
		argv := srv.argv(sock, size)
		cmd := exec.Command(argv[0], argv[1:]...)
		cmd.Env = env
		var serr bytes.Buffer
		cmd.Stderr = &serr
		if err := cmd.Start(); err != nil {
			return sample{}, err
		}
		defer stopServer(cmd)
		if err := waitSocket(sock); err != nil {
			return sample{}, fmt.Errorf("%v: %s", err, serr.String())
		}
		pid = cmd.Process.Pid
	}
	env = append(env, "SIZE="+size, "RUNTIME="+strconv.Itoa(runtime))
	engine := srv.fio(sock)
	if strings.Contains(job, "read") && srv.empty {
		if _, _, err := fio(env, engine, filepath.Join(jobsDir, "prefill.fio"), runtime*20); err != nil {
			return sample{}, fmt.Errorf("prefill: %w", err)
		}
	}
	cpu0, err := cpuSeconds(pid)
	if err != nil {
		return sample{}, err
	}
	box0, err := boxCPU()
	if err != nil {
		return sample{}, err
	}
	res, clientCPU, err := fio(env, engine, filepath.Join(jobsDir, job+".fio"), runtime*5+60)
	if err != nil {
		return sample{}, err
	}
	cpu1, err := cpuSeconds(pid)
	if err != nil {
		return sample{}, err
	}
	box1, err := boxCPU()
	if err != nil {
		return sample{}, err
	}
	s := sample{Server: srv.Name, Job: job, CPUSec: cpu1 - cpu0}
	for _, j := range res.Jobs {
		for _, d := range []fioDir{j.Read, j.Write} {
			s.IOPS += d.IOPS
			s.MiBps += float64(d.BWBytes) / (1 << 20)
			s.IOs += d.TotalIOs
			s.P99us = max(s.P99us, d.ClatNs.Percentile["99.000000"]/1000)
		}
	}
	if s.IOs > 0 {
		s.CPUusPerIO = s.CPUSec * 1e6 / float64(s.IOs)
		s.ClientCPUusPerIO = clientCPU * 1e6 / float64(s.IOs)
		s.BoxCPUusPerIO = (box1.busy - box0.busy) * 1e6 / float64(s.IOs)
	}
	if all := box1.all - box0.all; all > 0 {
		s.BoxBusy = (box1.busy - box0.busy) / all
	}
	return s, nil
}

func stopServer(cmd *exec.Cmd) {
	cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		cmd.Process.Kill()
		<-done
	}
}

func waitSocket(sock string) error {
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if c, err := net.Dial("unix", sock); err == nil {
			c.Close()
			return nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	return fmt.Errorf("server did not listen on %s", sock)
}

type fioDir struct {
	IOPS     float64 `json:"iops"`
	BWBytes  int64   `json:"bw_bytes"`
	TotalIOs int64   `json:"total_ios"`
	ClatNs   struct {
		Percentile map[string]float64 `json:"percentile"`
	} `json:"clat_ns"`
}

type fioResult struct {
	Jobs []struct {
		Error int    `json:"error"`
		Read  fioDir `json:"read"`
		Write fioDir `json:"write"`
	} `json:"jobs"`
}

// fio runs one job file and returns its results and fio's CPU seconds
// (its job processes included: wait4 counts the children it reaped).
func fio(env, engine []string, jobfile string, timeout int) (*fioResult, float64, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(timeout)*time.Second)
	defer cancel()
	args := append(append([]string{"--output-format=json"}, engine...), jobfile)
	cmd := exec.CommandContext(ctx, "fio", args...)
	cmd.Env = env
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return nil, 0, fmt.Errorf("fio %s: %v: %s", filepath.Base(jobfile), err, errb.String())
	}
	cpu := (cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()).Seconds()
	b := out.Bytes()
	if i := bytes.IndexByte(b, '{'); i > 0 {
		b = b[i:] // the nbd engine prints a line before the JSON
	}
	var r fioResult
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, 0, fmt.Errorf("fio json: %w", err)
	}
	for _, j := range r.Jobs {
		if j.Error != 0 {
			return nil, 0, fmt.Errorf("fio job error %d", j.Error)
		}
	}
	return &r, cpu, nil
}

// cpuSeconds is utime+stime of pid (all its threads) from /proc/PID/stat;
// 0 for pid 0 (no server process).
func cpuSeconds(pid int) (float64, error) {
	if pid == 0 {
		return 0, nil
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// Fields after the parenthesised command name; utime, stime are 14, 15.
	f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+2:]))
	ut, _ := strconv.ParseFloat(f[11], 64)
	st, _ := strconv.ParseFloat(f[12], 64)
	return (ut + st) / 100, nil // USER_HZ is 100 on Linux
}

// cpuTimes is the box's CPU time in seconds summed over all CPUs: busy
// (user, nice, system, irq, softirq, steal) and all (busy, idle, iowait).
type cpuTimes struct{ busy, all float64 }

// boxCPU reads the aggregate "cpu" line of /proc/stat (in USER_HZ = 100
// ticks per second on Linux).
func boxCPU() (cpuTimes, error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return cpuTimes{}, err
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 9 || f[0] != "cpu" {
		return cpuTimes{}, fmt.Errorf("/proc/stat: unexpected first line %q", line)
	}
	var t [8]float64
	for i := range t {
		if t[i], err = strconv.ParseFloat(f[i+1], 64); err != nil {
			return cpuTimes{}, fmt.Errorf("/proc/stat: %w", err)
		}
	}
	busy := t[0] + t[1] + t[2] + t[5] + t[6] + t[7]
	return cpuTimes{busy: busy / 100, all: (busy + t[3] + t[4]) / 100}, nil
}

// pickServers keeps the contenders named in list (all when it is empty),
// and the baseline, which every ratio needs.
func pickServers(all []server, baseline, list string) ([]server, error) {
	if list == "" {
		return all, nil
	}
	want := map[string]bool{baseline: true}
	for _, n := range strings.Split(list, ",") {
		want[strings.TrimSpace(n)] = true
	}
	var out []server
	for _, s := range all {
		if want[s.Name] {
			out = append(out, s)
			delete(want, s.Name)
		}
	}
	if len(want) > 0 {
		var names []string
		for n := range want {
			names = append(names, n)
		}
		slices.Sort(names)
		return nil, fmt.Errorf("-servers: no contender named %s", strings.Join(names, ", "))
	}
	return out, nil
}
