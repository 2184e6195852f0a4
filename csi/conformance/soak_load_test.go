package conformance

import (
	"bufio"
	"bytes"
	"fmt"
	"hash/crc32"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// The chaos soak's load on one volume: fio verify passes, one after
// another, and an append log whose every fsync'd record is checked at the
// end. Both note the slowest completion of each second, so a fault's
// stall is read off afterwards.

// recSize is one append-log record: small, so a 30-minute soak writes
// tens of MiB per volume, not gigabytes.
const recSize = 512

// load is what runs against one published volume.
type load struct {
	name, path string // the volume's name; its mount (a directory) or its device
	block      bool
	latDir     string // fio's latency logs

	logFile   string // the append log: a file in the mount, or the device itself
	logOffset int64  // where the log starts on a device

	mu      sync.Mutex
	acked   int                  // records fsync'd and acknowledged
	slowest map[int64]completion // unix second -> its slowest completion, both loads
	passes  int
	errs    []string
	stop    chan struct{}
	wg      sync.WaitGroup
}

// completion is one I/O's: when it completed, and how long it took.
type completion struct {
	at   time.Time
	took time.Duration
}

func newLoad(name, path string, block bool, latDir string) *load {
	l := &load{name: name, path: path, block: block, latDir: latDir, slowest: map[int64]completion{}, stop: make(chan struct{})}
	l.logFile = filepath.Join(path, "log")
	if block {
		l.logFile, l.logOffset = path, 64<<20 // fio uses the first 16 MiB
	}
	return l
}

func (l *load) start() {
	l.wg.Add(2)
	go l.fioLoop()
	go l.appendLoop()
}

// finish stops both loads at a clean point and waits for them.
func (l *load) finish() {
	close(l.stop)
	l.wg.Wait()
}

func (l *load) fail(format string, args ...any) {
	l.mu.Lock()
	l.errs = append(l.errs, fmt.Sprintf(format, args...))
	l.mu.Unlock()
}

func (l *load) note(at time.Time, took time.Duration) {
	l.mu.Lock()
	if s := at.Unix(); took > l.slowest[s].took {
		l.slowest[s] = completion{at, took}
	}
	l.mu.Unlock()
}

func (l *load) stopped() bool {
	select {
	case <-l.stop:
		return true
	default:
		return false
	}
}

// fioLoop runs one fio pass after another, each writing 1 MiB at random
// at a steady rate and reading it all back with crc32c verify, until
// stopped. The rate keeps eight volumes from starving the daemon on two
// emulated CPUs; a soak is about faults, not throughput. A pass is small
// because the soak's end waits for the one under way (its verify covers
// the last fault): 4 MiB passes took 5.5 min to end in TCG.
func (l *load) fioLoop() {
	defer l.wg.Done()
	target := l.path
	if !l.block {
		target = filepath.Join(l.path, "f")
	}
	for pass := 0; !l.stopped(); pass++ {
		prefix := filepath.Join(l.latDir, fmt.Sprintf("%s-%d", l.name, pass))
		cmd := exec.Command("fio", "--name=verify", "--filename="+target, "--size=1M", "--ioengine=libaio",
			"--direct=1", "--rw=randwrite", "--bs=4k", "--iodepth=4", "--rate_iops=100", "--verify=crc32c",
			"--verify_fatal=1", "--do_verify=1", "--output-format=terse", "--terse-version=3",
			"--write_lat_log="+prefix, "--log_avg_msec=1000", "--log_max_value=1", "--log_unix_epoch=1")
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		err := cmd.Run()
		ok := err == nil && strings.Contains(out.String(), "3;")
		for _, line := range strings.Split(out.String(), "\n") {
			if f := strings.Split(line, ";"); len(f) > 5 && f[0] == "3" && f[4] != "0" {
				ok = false
			}
		}
		if !ok {
			l.fail("fio pass %d: %v\n%s", pass, err, tail(out.String(), 8))
			return
		}
		l.readLatLogs(prefix)
		l.mu.Lock()
		l.passes++
		l.mu.Unlock()
	}
}

// readLatLogs folds one pass's completion-latency log (the slowest
// completion of each second, stamped in epoch ms, in ns) into slowest.
func (l *load) readLatLogs(prefix string) {
	files, _ := filepath.Glob(prefix + "_clat.*.log")
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(bytes.NewReader(b))
		for sc.Scan() {
			fs := strings.Split(sc.Text(), ",")
			if len(fs) < 2 {
				continue
			}
			ms, err1 := strconv.ParseInt(strings.TrimSpace(fs[0]), 10, 64)
			ns, err2 := strconv.ParseInt(strings.TrimSpace(fs[1]), 10, 64)
			if err1 == nil && err2 == nil {
				l.note(time.UnixMilli(ms), time.Duration(ns))
			}
		}
		os.Remove(f)
	}
}

// record is the content of append-log record n of a volume: its number,
// and bytes that depend on both, under a checksum.
func record(vol string, n int) []byte {
	b := make([]byte, recSize)
	body := b[:recSize-9]
	head := copy(body, fmt.Sprintf("%s record %08d ", vol, n))
	for i := head; i < len(body); i++ {
		body[i] = byte('a' + (n*31+i)%26)
	}
	copy(b[recSize-9:], fmt.Sprintf("%08x\n", crc32.ChecksumIEEE(body)))
	return b
}

// appendLoop appends a record, fsyncs, and only then counts it as
// acknowledged, as a database's log does, every 20 ms until stopped.
func (l *load) appendLoop() {
	defer l.wg.Done()
	flags := os.O_WRONLY | os.O_CREATE | os.O_APPEND
	if l.block {
		flags = os.O_WRONLY
	}
	f, err := os.OpenFile(l.logFile, flags, 0o644)
	if err != nil {
		l.fail("open the append log: %v", err)
		return
	}
	defer f.Close()
	for n := 0; !l.stopped(); n++ {
		t0 := time.Now()
		rec := record(l.name, n)
		if l.block {
			_, err = f.WriteAt(rec, l.logOffset+int64(n)*recSize)
		} else {
			_, err = f.Write(rec)
		}
		if err == nil {
			err = f.Sync()
		}
		if err != nil {
			l.fail("append record %d: %v", n, err)
			return
		}
		now := time.Now()
		l.note(now, now.Sub(t0))
		l.mu.Lock()
		l.acked = n + 1
		l.mu.Unlock()
		time.Sleep(20 * time.Millisecond)
	}
}

// checkLog reads the append log back from the device (the caller drops
// the page cache first) and returns an error for the first acknowledged
// record that is missing or wrong.
func (l *load) checkLog() error {
	f, err := os.Open(l.logFile)
	if err != nil {
		return err
	}
	defer f.Close()
	buf := make([]byte, recSize)
	for n := 0; n < l.acked; n++ {
		if _, err := f.ReadAt(buf, l.logOffset+int64(n)*recSize); err != nil {
			return fmt.Errorf("acknowledged record %d of %d: %v", n, l.acked, err)
		}
		if !bytes.Equal(buf, record(l.name, n)) {
			return fmt.Errorf("acknowledged record %d of %d reads %q", n, l.acked, bytes.TrimRight(buf[:40], "\x00"))
		}
	}
	return nil
}

// slowestIn is the slowest completion of this volume's loads in [from,
// to), and the second it completed in.
func (l *load) slowestIn(from, to time.Time) (time.Duration, time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slowestIn(l.slowest, from, to)
}

// slowestIn is the slowest completion in [from, to), and when it
// completed.
func slowestIn(slowest map[int64]completion, from, to time.Time) (time.Duration, time.Time) {
	var m completion
	for s, c := range slowest {
		if s >= from.Unix() && s < to.Unix() && c.took > m.took {
			m = c
		}
	}
	return m.took, m.at
}

func (l *load) waitedAfter(from, to, begunBy time.Time) time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	return waitedAfter(l.slowest, from, to, begunBy)
}

// waitedAfter is the longest any I/O completing in [from, to) and begun
// by begunBy waited after from: its time, less the part it had already
// waited when the fault came. A write that began 10 s before a kill and
// completed 6 s after it waited 6 s for the fault; its 16 s are the
// stall before. One begun after the fault had recovered (begunBy) waited
// on the machine, not on the fault: a slow spell a minute after an
// upgrade is the floor's. (fio logs the slowest completion of each
// second, stamped at the second's end: the wait is at most 1 s over,
// and an I/O counts if it may have begun by begunBy. The slowest of a
// second began first, so it alone decides.)
func waitedAfter(slowest map[int64]completion, from, to, begunBy time.Time) time.Duration {
	var m time.Duration
	for s, c := range slowest {
		if s >= from.Unix() && s < to.Unix() && !c.at.Add(-c.took-time.Second).After(begunBy) {
			m = max(m, min(c.took, c.at.Sub(from)))
		}
	}
	return m
}

// dropCaches makes the next reads of every file and device come from the
// devices, so the log check reads what the cluster holds.
func dropCaches() error {
	syscall.Sync()
	return os.WriteFile("/proc/sys/vm/drop_caches", []byte("3\n"), 0o200)
}

// fault is one injected event, as the report shows it.
type fault struct {
	kind      string
	at        time.Duration // since the soak began
	start     time.Time
	recovered time.Duration // until the thing faulted answered again
	end       time.Time     // the next fault's start, or the soak's end
	stall     time.Duration // the slowest completion in [start, end)
	waited    time.Duration // the longest any I/O waited after start, of those
	where     string        // which volume, and when it completed
	paused    time.Duration // an upgrade's: how long the sockets went unread
	detail    string
}

// baseline is the slowest completion in a window with no fault under
// way: what the loads wait anyway on this machine (TCG's emulated
// CPUs, one OSD), below which no fault's stall can be measured.
type baseline struct {
	from, to time.Time
	slowest  time.Duration
}

// baselineSkip leaves out the loads' first seconds (fio laying out its
// files, the first appends) from the baseline.
const baselineSkip = 5 * time.Second

// report renders the soak's fault table and the worst stall per kind, in
// markdown, for bench/reference.
func report(seed int64, took time.Duration, vols []string, faults []fault, loads []*load, targets map[string]string, base baseline) string {
	var b strings.Builder
	fmt.Fprintf(&b, "# Chaos soak, %s\n\n", time.Now().UTC().Format("2006-01-02 15:04 UTC"))
	fmt.Fprintf(&b, "Seed %d, %s of faults, %d volumes (%s).\n", seed, took.Round(time.Second), len(vols), strings.Join(vols, ", "))
	records, passes := 0, 0
	for _, l := range loads {
		records += l.acked
		passes += l.passes
	}
	fmt.Fprintf(&b, "%d fio verify passes and %d fsync'd append records, every one read back.\n", passes, records)
	if w := base.to.Sub(base.from); w > 0 {
		fmt.Fprintf(&b, "With no fault under way (the %s before the first one), the slowest I/O completion was %s: the floor under every stall below.\n",
			w.Round(time.Second), base.slowest.Round(100*time.Millisecond))
	}
	b.WriteString("\n")
	b.WriteString("| # | at | fault | recovered in | longest I/O stall | waited after the fault | where | |\n|---:|---:|---|---:|---:|---:|---|---|\n")
	for i, f := range faults {
		fmt.Fprintf(&b, "| %d | %s | %s | %s | %s | %s | %s | %s |\n", i+1, f.at.Round(time.Second), f.kind,
			f.recovered.Round(100*time.Millisecond), f.stall.Round(100*time.Millisecond), f.waited.Round(100*time.Millisecond), f.where, f.detail)
	}
	b.WriteString("\n| fault | times | worst stall | worst wait after the fault | target |\n|---|---:|---:|---:|---|\n")
	kinds, waits := map[string][]time.Duration{}, map[string]time.Duration{}
	for _, f := range faults {
		kinds[f.kind] = append(kinds[f.kind], f.stall)
		waits[f.kind] = max(waits[f.kind], f.waited)
	}
	names := make([]string, 0, len(kinds))
	for k := range kinds {
		names = append(names, k)
	}
	sort.Strings(names)
	for _, k := range names {
		worst := time.Duration(0)
		for _, d := range kinds[k] {
			worst = max(worst, d)
		}
		fmt.Fprintf(&b, "| %s | %d | %s | %s | %s |\n", k, len(kinds[k]), worst.Round(100*time.Millisecond), waits[k].Round(100*time.Millisecond), targets[k])
	}
	if p, n, under := pausedSummary(faults); p > 0 {
		fmt.Fprintf(&b, "\nHandovers: the kernel's sockets went unread for at most %s, %d of %d handovers within 1 s (the new daemon's reads_paused_for: from the old one's last new read to every device read again), the handover's own share of an upgrade's stall; the rest is the floor and the new pod's start.\n",
			p.Round(10*time.Millisecond), under, n)
	}
	b.WriteString("\nThe stall is the slowest I/O completion (fio's per-second maximum, or one append+fsync) on any volume between the fault and the next one; where says which volume, and when it completed, from the fault's start. The wait after the fault counts only the part of each I/O after the fault began, and only I/O begun before the fault had recovered (both to 1 s: fio logs each second's slowest): a request already slow before the fault is not charged to it in full, nor one begun after it recovered, which waited on the machine.\n")
	return b.String()
}

// lastReadsPaused is the reads_paused_for of the daemon log's last
// takeover, or 0.
func lastReadsPaused(log string) time.Duration {
	lines := strings.Split(log, "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		if !strings.Contains(lines[i], `msg="took over from the previous daemon"`) {
			continue
		}
		for _, w := range strings.Fields(lines[i]) {
			if v, ok := strings.CutPrefix(w, "reads_paused_for="); ok {
				d, _ := time.ParseDuration(v)
				return d
			}
		}
		return 0
	}
	return 0
}

// pausedSummary is the longest unread spell of the run's handovers, how
// many there were, and how many kept within issue 27's 1 s.
func pausedSummary(faults []fault) (worst time.Duration, n, under int) {
	for _, f := range faults {
		if f.paused <= 0 {
			continue
		}
		worst = max(worst, f.paused)
		n++
		if f.paused <= time.Second {
			under++
		}
	}
	return worst, n, under
}
