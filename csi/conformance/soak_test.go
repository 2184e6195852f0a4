package conformance

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/rbd-nbd-go/rbd-nbd-go/control"
)

// The chaos soak (make soak: 30 minutes; make test: 5): eight CSI
// volumes under load while the node plugin, its daemon and the OSD are
// killed, upgraded and cut off, one fault at a time. It runs only with
// RBD_NBD_GO_SOAK set to a duration, against a bluestore OSD (a killed
// memstore OSD takes the data with it).

func soakDuration() time.Duration {
	d, _ := time.ParseDuration(os.Getenv("RBD_NBD_GO_SOAK"))
	return d
}

// The faults, and what issue 27 asks of each.
const (
	fDaemonKill  = "daemon kill -9"
	fPodKill     = "plugin+daemon kill -9"
	fUpgrade     = "SIGTERM upgrade, overlapping"
	fStop        = "SIGTERM, no overlap"
	fOSDKill     = "OSD kill -9, restart"
	fUnreachable = "OSD unreachable 15 s"
)

// faultNames: every fault, in the deck's order, and the short name
// RBD_NBD_GO_SOAK_FAULTS knows it by.
var faultNames = []struct{ short, kind string }{
	{"daemon-kill", fDaemonKill}, {"pod-kill", fPodKill}, {"upgrade", fUpgrade},
	{"stop", fStop}, {"osd-kill", fOSDKill}, {"osd-cut", fUnreachable},
}

// soakKinds are the faults dealt: all six, or those RBD_NBD_GO_SOAK_FAULTS
// names (comma-separated short names, e.g. "upgrade" to measure only
// the handover).
func soakKinds() ([]string, error) {
	var kinds, shorts []string
	for _, f := range faultNames {
		shorts = append(shorts, f.short)
	}
	env := os.Getenv("RBD_NBD_GO_SOAK_FAULTS")
	if env == "" {
		for _, f := range faultNames {
			kinds = append(kinds, f.kind)
		}
		return kinds, nil
	}
	for _, n := range strings.Split(env, ",") {
		i := slices.Index(shorts, strings.TrimSpace(n))
		if i < 0 {
			return nil, fmt.Errorf("RBD_NBD_GO_SOAK_FAULTS: no fault %q (%s)", n, strings.Join(shorts, ", "))
		}
		kinds = append(kinds, faultNames[i].kind)
	}
	return kinds, nil
}

var soakTargets = map[string]string{
	fDaemonKill: "≤ 10 s", fPodKill: "≤ 10 s", fUpgrade: "≤ 1 s", fStop: "≤ 30 s, 0 errors",
	fOSDKill: "0 errors; ≈ the OSD's restart", fUnreachable: "0 errors",
}

// soak is the rig: the plugin "pod", the cluster, the volumes.
type soak struct {
	t     *testing.T
	p     *plugin
	vols  []*volumeRig
	names []string
	loads []*load
}

func TestChaosSoak(t *testing.T) {
	dur := soakDuration()
	if dur <= 0 {
		t.Skip("the chaos soak runs with RBD_NBD_GO_SOAK=DURATION (make soak, make test)")
	}
	needNode(t)
	if out, err := exec.Command("iptables-legacy", "-L", "INPUT", "-n").CombinedOutput(); err != nil {
		t.Fatalf("iptables, to cut the OSD off: %v: %s (e2e/csi.sh loads the modules)", err, out)
	}
	kinds, err := soakKinds()
	if err != nil {
		t.Fatal(err)
	}
	seed := time.Now().UnixNano()
	if s := os.Getenv("RBD_NBD_GO_SOAK_SEED"); s != "" {
		seed, _ = strconv.ParseInt(s, 10, 64)
	}
	t.Logf("soak: seed %d (RBD_NBD_GO_SOAK_SEED=%d repeats the faults), %s, faults: %s", seed, seed, dur, strings.Join(kinds, ", "))
	rng := rand.New(rand.NewSource(seed))

	s := &soak{t: t}
	tUp := time.Now()
	s.up()
	for _, l := range s.loads {
		l.start()
	}
	t0 := time.Now()
	t.Logf("soak: %d volumes up in %s", len(s.vols), t0.Sub(tUp).Round(100*time.Millisecond))
	var faults []fault
	var deck []string
	seen := map[string]bool{}
	// A fault every 20-60 s, the last one starting within the duration;
	// but until every kind has been dealt at least once (capped at twice
	// the duration): a short soak tests them all. A short one (make
	// test's 5 minutes) keeps to the low end, 20-30 s, so that the six
	// fit in about its duration instead of half as long again.
	gapMax := 60
	if dur < 10*time.Minute {
		gapMax = 30
	}
	for !s.loadFailed() {
		gap := time.Duration(20+rng.Intn(gapMax-19)) * time.Second
		if at := time.Since(t0) + gap; at >= 2*dur || at >= dur && len(seen) == len(kinds) {
			break
		}
		time.Sleep(gap)
		if s.loadFailed() {
			break
		}
		if len(deck) == 0 {
			deck = append(deck, kinds...)
			rng.Shuffle(len(deck), func(i, j int) { deck[i], deck[j] = deck[j], deck[i] })
		}
		f := fault{kind: deck[0], start: time.Now(), at: time.Since(t0)}
		deck = deck[1:]
		seen[f.kind] = true
		var err error
		dlog := filepath.Join(s.p.dir, "state", "daemon.log")
		seenLog := len(readFile(dlog))
		f.recovered, f.detail, err = s.inject(f.kind)
		if f.kind == fUpgrade {
			// Only this upgrade's takeover: a refused handover has none.
			if l := readFile(dlog); len(l) >= seenLog {
				f.paused = lastReadsPaused(l[seenLog:])
			}
			if f.paused > 0 {
				f.detail += fmt.Sprintf("; sockets unread %s", f.paused.Round(10*time.Millisecond))
			}
		}
		t.Logf("soak: %s at %s: recovered in %s %s", f.kind, f.at.Round(time.Second), f.recovered.Round(100*time.Millisecond), f.detail)
		faults = append(faults, f)
		if err != nil {
			t.Errorf("%s: %v", f.kind, err)
			break
		}
	}
	// A quiet spell, so the last fault's stall falls in its window.
	time.Sleep(20 * time.Second)
	end := time.Now()
	for _, l := range s.loads {
		l.finish()
	}
	// A pass under way runs to its end: its verify covers the last fault.
	t.Logf("soak: loads ended their passes in %s", time.Since(end).Round(100*time.Millisecond))
	for i := range faults {
		faults[i].end = end
		if i+1 < len(faults) {
			faults[i].end = faults[i+1].start
		}
		for _, l := range s.loads {
			if d, at := l.slowestIn(faults[i].start, faults[i].end); d > faults[i].stall {
				faults[i].stall = d
				faults[i].where = fmt.Sprintf("%s, +%s", l.name, at.Sub(faults[i].start).Round(time.Second))
			}
			faults[i].waited = max(faults[i].waited, l.waitedAfter(faults[i].start, faults[i].end,
				faults[i].start.Add(faults[i].recovered)))
		}
	}
	// The floor every stall stands on: the slowest completion with no
	// fault under way, from the loads' first seconds to the first fault.
	var base baseline
	if len(faults) > 0 {
		base.from, base.to = t0.Add(baselineSkip), faults[0].start
		for _, l := range s.loads {
			d, _ := l.slowestIn(base.from, base.to)
			base.slowest = max(base.slowest, d)
		}
	}
	s.check()
	s.keepLogs()
	rep := report(seed, end.Sub(t0), s.names, faults, s.loads, soakTargets, base)
	t.Logf("soak report:\n%s", rep)
	if out := os.Getenv("RBD_NBD_GO_SOAK_REPORT"); out != "" {
		os.WriteFile(out, []byte(rep), 0o644)
	}
	tDown := time.Now()
	s.down()
	t.Logf("soak: torn down and checked in %s", time.Since(tDown).Round(100*time.Millisecond))
}

// up starts the plugin and brings eight volumes to a pod: three ext4,
// three xfs and two raw block, staged in parallel as a node starting a
// deployment's pods does.
func (s *soak) up() {
	t := s.t
	dir := t.TempDir()
	r0 := newVolumeRigIn(t, dir)
	s.p = r0.p
	fss := []string{"ext4", "xfs", "block", "ext4", "xfs", "block", "ext4", "xfs"}
	s.vols = make([]*volumeRig, len(fss))
	s.loads = make([]*load, len(fss))
	errs := make([]error, len(fss))
	var wg sync.WaitGroup
	for i, fs := range fss {
		name := fmt.Sprintf("soak-%d-%s", i, fs)
		s.names = append(s.names, name)
		c := blockRWO
		if fs != "block" {
			c = fsCap(fs, rwo)
		}
		r := &volumeRig{t: t, p: s.p, cc: r0.cc, nc: r0.nc, ctx: r0.ctx, dir: dir, cap: c,
			staging: filepath.Join(dir, "staging", name)}
		s.vols[i] = r
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			target, err := r.up(name)
			errs[i] = err
			lat := filepath.Join(dir, "lat")
			os.MkdirAll(lat, 0o755)
			s.loads[i] = newLoad(name, target, fs == "block", lat)
		}(i)
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("%s: %v", s.names[i], err)
		}
	}
}

// up is create, ControllerPublish, NodeStage and NodePublish with errors
// returned, for callers off the test's goroutine.
func (r *volumeRig) up(name string) (string, error) {
	resp, err := r.cc.CreateVolume(r.ctx, &csi.CreateVolumeRequest{Name: name, CapacityRange: &csi.CapacityRange{RequiredBytes: 320 << 20},
		VolumeCapabilities: []*csi.VolumeCapability{r.cap}, Parameters: map[string]string{"clusterID": "dev", "pool": "rbd"},
		Secrets: secrets()})
	if err != nil {
		return "", fmt.Errorf("CreateVolume: %v", err)
	}
	r.vol = resp.Volume
	pub, err := r.cc.ControllerPublishVolume(r.ctx, &csi.ControllerPublishVolumeRequest{VolumeId: r.vol.VolumeId,
		NodeId: "sanity-node", VolumeCapability: r.cap})
	if err != nil {
		return "", fmt.Errorf("ControllerPublish: %v", err)
	}
	r.pubCtx = pub.PublishContext
	os.MkdirAll(r.staging, 0o750)
	if _, err = r.nc.NodeStageVolume(r.ctx, &csi.NodeStageVolumeRequest{VolumeId: r.vol.VolumeId, StagingTargetPath: r.staging,
		VolumeCapability: r.cap, Secrets: secrets(), VolumeContext: r.vol.VolumeContext, PublishContext: r.pubCtx}); err != nil {
		return "", fmt.Errorf("NodeStage: %v", err)
	}
	target := filepath.Join(r.dir, "pods", name, "mount")
	if _, err = r.nc.NodePublishVolume(r.ctx, &csi.NodePublishVolumeRequest{VolumeId: r.vol.VolumeId, StagingTargetPath: r.staging,
		TargetPath: target, VolumeCapability: r.cap, PublishContext: r.pubCtx, VolumeContext: r.vol.VolumeContext}); err != nil {
		return "", fmt.Errorf("NodePublish: %v", err)
	}
	return target, nil
}

func (s *soak) loadFailed() bool {
	for _, l := range s.loads {
		l.mu.Lock()
		n := len(l.errs)
		l.mu.Unlock()
		if n > 0 {
			return true
		}
	}
	return false
}

// inject does one fault and waits until what it hit answers again: every
// device served, or the OSD serving. It returns that time.
func (s *soak) inject(kind string) (time.Duration, string, error) {
	t0 := time.Now()
	switch kind {
	case fDaemonKill:
		old := s.p.daemonPID()
		syscall.Kill(old, syscall.SIGKILL)
		// The plugin's supervisor starts another as soon as its child exits.
		err := s.devicesBack(func() bool { d := s.p.daemonPID(); return d != old && d > 0 && syscall.Kill(d, 0) == nil })
		return time.Since(t0), "", err
	case fPodKill, fStop:
		sig := syscall.SIGKILL
		if kind == fStop {
			sig = syscall.SIGTERM
		}
		s.p.conn.Close()
		s.p.signal(sig)
		time.Sleep(time.Second) // the kubelet starts the container again
		t1 := time.Now()
		s.p.start()
		answered := time.Since(t1)
		err := s.p.ready(2 * time.Minute)
		ready := time.Since(t0)
		if err == nil {
			err = s.devicesBack(nil)
		}
		// The old plugin's stop (a SIGTERM's: its daemon closes every
		// image) comes before the new one's start, as in a pod.
		r := func(d time.Duration) time.Duration { return d.Round(100 * time.Millisecond) }
		return time.Since(t0), fmt.Sprintf("plugin answering %s after its start (%s after the kill), ready %s after the kill",
			r(answered), r(t1.Sub(t0)+answered), r(ready)), err
	case fUpgrade:
		oldPlugin, oldDaemon := s.p.cmd, s.p.daemonPID()
		s.p.conn.Close()
		s.p.start()
		for syscall.Kill(oldDaemon, 0) == nil {
			if time.Since(t0) > 2*time.Minute {
				return time.Since(t0), "", fmt.Errorf("the old daemon (pid %d) did not hand over and exit", oldDaemon)
			}
			time.Sleep(50 * time.Millisecond)
		}
		handed := time.Since(t0)
		oldPlugin.Process.Signal(syscall.SIGTERM)
		oldPlugin.Wait()
		err := s.devicesBack(nil)
		return time.Since(t0), fmt.Sprintf("old daemon handed over and exited in %s", handed.Round(100*time.Millisecond)), err
	case fOSDKill:
		pid, err := cluster.c.OSDPid()
		if err != nil {
			return 0, "", err
		}
		syscall.Kill(pid, syscall.SIGKILL)
		for syscall.Kill(pid, 0) == nil {
			time.Sleep(10 * time.Millisecond)
		}
		time.Sleep(time.Second)
		err = cluster.c.RestartOSD()
		return time.Since(t0), "", err
	case fUnreachable:
		ports, err := osdPorts()
		if err != nil {
			return 0, "", err
		}
		if err := cutOff(ports, "-I"); err != nil {
			cutOff(ports, "-D")
			return 0, "", err
		}
		time.Sleep(15 * time.Second)
		if err := cutOff(ports, "-D"); err != nil {
			return 0, "", err
		}
		err = exec.Command("timeout", "120", "rados", "-c", cluster.c.Conf, "-p", "rbd", "ls").Run()
		return time.Since(t0), fmt.Sprintf("ports %v dropped", ports), err
	}
	return 0, "", fmt.Errorf("no fault %q", kind)
}

// devicesBack waits (up to 2 minutes) for ready, if any, and then for
// the daemon to list every volume's device again. It asks the control
// socket in-process until a daemon answers there (a restarted daemon
// answers once it has taken its devices back), and only then runs the
// CLI's list-mapped: run every 100 ms while no daemon answers, the CLI
// started a daemon of its own each time (the healer's behaviour, with
// devices recorded), each exec a second or more of the VM's two CPUs,
// which the daemon being measured then waited for.
func (s *soak) devicesBack(ready func() bool) error {
	c := &control.Client{StateDir: filepath.Join(s.p.dir, "state")}
	deadline := time.Now().Add(2 * time.Minute)
	for time.Now().Before(deadline) {
		if (ready == nil || ready()) && answers(c) {
			if n := s.mappedCount(); n == len(s.vols) {
				return nil
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	return fmt.Errorf("the daemon lists %d devices 2 minutes on, want %d", s.mappedCount(), len(s.vols))
}

// answers tells whether a daemon answers on the control socket; it never
// starts one.
func answers(c *control.Client) bool {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return c.Ping(ctx) == nil
}

func (s *soak) mappedCount() int {
	var l []map[string]any
	if json.Unmarshal([]byte(s.vols[0].mapped()), &l) != nil {
		return -1
	}
	return len(l)
}

var listenPid = regexp.MustCompile(`:(\d+)\s.*pid=(\d+),`)

// osdPorts are the TCP ports the OSD listens on.
func osdPorts() ([]string, error) {
	pid, err := cluster.c.OSDPid()
	if err != nil {
		return nil, err
	}
	out, err := exec.Command("ss", "-Hltnp").Output()
	if err != nil {
		return nil, fmt.Errorf("ss: %v", err)
	}
	var ports []string
	for _, line := range strings.Split(string(out), "\n") {
		if m := listenPid.FindStringSubmatch(line); m != nil && m[2] == strconv.Itoa(pid) {
			ports = append(ports, m[1])
		}
	}
	if len(ports) == 0 {
		return nil, fmt.Errorf("the OSD (pid %d) listens on no TCP port:\n%s", pid, out)
	}
	return ports, nil
}

// cutOff inserts (-I) or deletes (-D) rules dropping every packet to or
// from the OSD's ports: clients and the monitor see it unreachable, with
// their connections open, as with a network partition.
func cutOff(ports []string, op string) error {
	for _, p := range ports {
		for _, dir := range []string{"--dport", "--sport"} {
			if out, err := exec.Command("iptables-legacy", op, "INPUT", "-p", "tcp", dir, p, "-j", "DROP").CombinedOutput(); err != nil {
				return fmt.Errorf("iptables %s %s %s: %v: %s", op, dir, p, err, out)
			}
		}
	}
	return nil
}

// check is the pass line: no I/O or verify error, every acknowledged
// record on the device, every filesystem read-write.
func (s *soak) check() {
	t := s.t
	for _, l := range s.loads {
		for _, e := range l.errs {
			t.Errorf("%s: %s", l.name, e)
		}
	}
	if err := dropCaches(); err != nil {
		t.Errorf("drop caches: %v", err)
	}
	for i, l := range s.loads {
		if err := l.checkLog(); err != nil {
			t.Errorf("%s: %v", l.name, err)
		}
		if !l.block && !mountedRW(t, l.path) {
			t.Errorf("%s: the filesystem is no longer read-write", s.names[i])
		}
		t.Logf("soak: %s: %d fio verify passes, %d records acknowledged and read back", l.name, l.passes, l.acked)
	}
}

// down takes every volume away as Kubernetes would, and checks nothing
// is left: no device, no stage record, no watcher or lock, no image.
func (s *soak) down() {
	t := s.t
	cc, nc := csi.NewControllerClient(s.p.conn), csi.NewNodeClient(s.p.conn)
	// The rig's context (10 minutes from its start) is long gone.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	var imgs []string
	for i, r := range s.vols {
		r.cc, r.nc, r.ctx = cc, nc, ctx
		r.unpublish(s.loads[i].path)
		r.detach()
		img := imageOf(r.vol.VolumeId)
		imgs = append(imgs, img)
		if out := run(t, "rbd", "status", "rbd/"+img); strings.Contains(out, "watcher=") {
			t.Errorf("%s: a watcher is left: %s", s.names[i], out)
		}
		if out := run(t, "rbd", "lock", "ls", "rbd/"+img); strings.TrimSpace(out) != "" {
			t.Errorf("%s: a lock is left: %s", s.names[i], out)
		}
		_, err := cc.DeleteVolume(r.ctx, &csi.DeleteVolumeRequest{VolumeId: r.vol.VolumeId, Secrets: secrets()})
		r.must("DeleteVolume", err)
	}
	if m := s.vols[0].mapped(); m != "[]" {
		t.Errorf("devices left: %s", m)
	}
	if ents, _ := os.ReadDir(filepath.Join(s.p.dir, "state", "csi", "volumes")); len(ents) != 0 {
		t.Errorf("stage records left: %v", ents)
	}
	left := " " + strings.Join(strings.Fields(run(t, "rbd", "ls", "rbd")), " ") + " "
	for i, img := range imgs {
		if strings.Contains(left, " "+img+" ") {
			t.Errorf("%s: image %s left", s.names[i], img)
		}
	}
}

// keepLogs copies the plugin's and daemon's logs and the kernel's to
// RBD_NBD_GO_SOAK_LOGS, if set, for reading a stall afterwards.
func (s *soak) keepLogs() {
	dir := os.Getenv("RBD_NBD_GO_SOAK_LOGS")
	if dir == "" {
		return
	}
	os.MkdirAll(dir, 0o755)
	for _, f := range []string{s.p.log, filepath.Join(s.p.dir, "state", "daemon.log")} {
		if b, err := os.ReadFile(f); err == nil {
			os.WriteFile(filepath.Join(dir, filepath.Base(f)), b, 0o644)
		}
	}
	if b, err := exec.Command("dmesg").Output(); err == nil {
		os.WriteFile(filepath.Join(dir, "dmesg.txt"), b, 0o644)
	}
}
