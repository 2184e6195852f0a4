package main

import (
	"math"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// chartPanels reads the panels of an SVG from chart: each bold title and
// the bar values drawn below it (from the bars' tooltips), by server.
func chartPanels(t *testing.T, svg string) (titles []string, bars []map[string][]float64) {
	t.Helper()
	re := regexp.MustCompile(`font-weight="bold">([^<]*)</text>|<title>(\S+) \S+: ([0-9.]+)×</title>`)
	for _, m := range re.FindAllStringSubmatch(svg, -1) {
		if m[1] != "" {
			titles = append(titles, m[1])
			bars = append(bars, map[string][]float64{})
			continue
		}
		if len(bars) == 0 {
			t.Fatalf("bar %q before any panel title", m[0])
		}
		v, err := strconv.ParseFloat(m[3], 64)
		if err != nil {
			t.Fatal(err)
		}
		bars[len(bars)-1][m[2]] = append(bars[len(bars)-1][m[2]], v)
	}
	return titles, bars
}

// The rbd suite's baseline, direct librbd, has no server process: a
// server CPU panel there is all zeros. The chart must plot what the
// ratios table compares instead, the box's and fio+server's CPU per I/O,
// with the table's figures.
func TestChartRBDComparesBoxAndFioServerCPU(t *testing.T) {
	var samples []sample
	for round := 1; round <= 2; round++ {
		samples = append(samples,
			sample{Server: "librbd-direct", Job: "read-1m-qd8", Round: round, IOPS: 1000,
				ClientCPUusPerIO: 600, BoxCPUusPerIO: 1500},
			sample{Server: "rbd-nbd-go", Job: "read-1m-qd8", Round: round, IOPS: 850,
				CPUusPerIO: 700, ClientCPUusPerIO: 300, BoxCPUusPerIO: 1800})
	}
	servers := []server{{Name: "librbd-direct"}, {Name: "rbd-nbd-go"}}
	r := summarize(samples, []string{"read-1m-qd8"}, servers, "librbd-direct", "rbd-nbd-go")
	titles, bars := chartPanels(t, chart(r))

	if len(titles) != 3 || !strings.HasPrefix(titles[0], "IOPS") ||
		!strings.HasPrefix(titles[1], "Whole box's CPU per I/O") || !strings.HasPrefix(titles[2], "fio+server CPU per I/O") {
		t.Fatalf("panels %q, want IOPS, whole box's CPU, fio+server CPU", titles)
	}
	j := r.Jobs[0]
	for i, want := range []float64{j.IOPSRatio, j.BoxCPURatio, j.TotalCPURatio} {
		if want == 0 {
			t.Fatalf("panel %q: the table has no ratio to chart", titles[i])
		}
		got := bars[i]
		if !slices.Equal(got["librbd-direct"], []float64{1}) {
			t.Errorf("panel %q: baseline bar %v, want [1]", titles[i], got["librbd-direct"])
		}
		if len(got["rbd-nbd-go"]) != 1 || math.Abs(got["rbd-nbd-go"][0]-want) > 0.005 {
			t.Errorf("panel %q: rbd-nbd-go bar %v, want the table's %.2f", titles[i], got["rbd-nbd-go"], want)
		}
	}
	if math.Abs(j.BoxCPURatio-1.2) > 1e-9 || math.Abs(j.TotalCPURatio-1000.0/600) > 1e-9 {
		t.Errorf("box ratio %v, fio+server ratio %v; want 1.2, 1.67", j.BoxCPURatio, j.TotalCPURatio)
	}
}

// Where the baseline has a server process (nbdkit), its lower panel stays
// the server's CPU per I/O, and only that.
func TestChartNBDKeepsServerCPU(t *testing.T) {
	samples := []sample{
		{Server: "nbdkit-memory", Job: "randread-4k-qd32", Round: 1, IOPS: 100000,
			CPUusPerIO: 9, ClientCPUusPerIO: 5, BoxCPUusPerIO: 20},
		{Server: "rbd-nbd-go", Job: "randread-4k-qd32", Round: 1, IOPS: 130000,
			CPUusPerIO: 6, ClientCPUusPerIO: 5, BoxCPUusPerIO: 15},
	}
	servers := []server{{Name: "rbd-nbd-go"}, {Name: "nbdkit-memory"}}
	r := summarize(samples, []string{"randread-4k-qd32"}, servers, "nbdkit-memory", "rbd-nbd-go")
	titles, bars := chartPanels(t, chart(r))
	if len(titles) != 2 || !strings.HasPrefix(titles[1], "Server CPU per I/O") {
		t.Fatalf("panels %q, want IOPS and server CPU", titles)
	}
	if got := bars[1]["rbd-nbd-go"]; len(got) != 1 || got[0] != 0.67 {
		t.Errorf("server CPU bar %v, want [0.67]", got)
	}
}

// The subject is also reported against the peer NBD server, per job and
// per round, and only where the peer ran.
func TestPeerRatios(t *testing.T) {
	var samples []sample
	for round, box := range []float64{200, 180, 220} {
		samples = append(samples,
			sample{Server: "librbd-direct", Job: "randwrite-4k-qd32", Round: round + 1, IOPS: 9000,
				ClientCPUusPerIO: 60, BoxCPUusPerIO: 150},
			sample{Server: "rbd-nbd-go", Job: "randwrite-4k-qd32", Round: round + 1, IOPS: 8000,
				CPUusPerIO: 60, ClientCPUusPerIO: 14, BoxCPUusPerIO: box},
			sample{Server: "qemu-nbd", Job: "randwrite-4k-qd32", Round: round + 1, IOPS: 7000,
				CPUusPerIO: 80, ClientCPUusPerIO: 14, BoxCPUusPerIO: 200},
			sample{Server: "librbd-direct", Job: "read-1m-qd8", Round: round + 1, IOPS: 1000,
				ClientCPUusPerIO: 600, BoxCPUusPerIO: 1500},
			sample{Server: "rbd-nbd-go", Job: "read-1m-qd8", Round: round + 1, IOPS: 900,
				CPUusPerIO: 700, ClientCPUusPerIO: 300, BoxCPUusPerIO: 1800})
	}
	servers := []server{{Name: "librbd-direct"}, {Name: "rbd-nbd-go"}, {Name: "qemu-nbd"}}
	r := summarize(samples, []string{"randwrite-4k-qd32", "read-1m-qd8"}, servers, "librbd-direct", "rbd-nbd-go")
	r.addPeer(samples, "qemu-nbd")
	p := r.Jobs[0].Peer
	if p == nil {
		t.Fatal("no peer ratios for a job the peer ran")
	}
	near := func(a, b float64) bool { return math.Abs(a-b) < 1e-9 }
	if !near(p.IOPS, 8000.0/7000) || !near(p.ServerCPU, 0.75) || !near(p.FioServerCPU, 74.0/94) || !near(p.BoxCPU, 1) {
		t.Errorf("peer ratios %+v", *p)
	}
	if !slices.Equal(p.RoundBoxCPU, []float64{1, 0.9, 1.1}) {
		t.Errorf("round box ratios %v, want [1 0.9 1.1]", p.RoundBoxCPU)
	}
	if r.Jobs[1].Peer != nil {
		t.Errorf("peer ratios %+v for a job the peer did not run", *r.Jobs[1].Peer)
	}
	md := markdown(r, "t", 10, 3)
	if !strings.Contains(md, "| randwrite-4k-qd32 | 1.14× | 0.75× | 0.79× | 1.00× | median 1.00× (0.90–1.10) |") {
		t.Errorf("markdown lacks the peer row:\n%s", md)
	}

	// Without the peer among the servers run, no peer section at all.
	r = summarize(samples, []string{"randwrite-4k-qd32"}, servers[:2], "librbd-direct", "rbd-nbd-go")
	r.addPeer(samples, "qemu-nbd")
	if r.Peer != "" || strings.Contains(markdown(r, "t", 10, 3), "NBD peer") {
		t.Error("peer section without the peer run")
	}
}

// A far outlier is drawn to the panel's top and no higher, with its true
// ratio, so the other bars keep their scale.
func TestChartClipsOutliers(t *testing.T) {
	samples := []sample{
		{Server: "librbd-direct", Job: "randread-4k-qd32", Round: 1, IOPS: 30000, ClientCPUusPerIO: 30, BoxCPUusPerIO: 50},
		{Server: "rbd-nbd-go", Job: "randread-4k-qd32", Round: 1, IOPS: 24000, CPUusPerIO: 31, ClientCPUusPerIO: 11, BoxCPUusPerIO: 60},
		{Server: "qemu-nbd", Job: "randread-4k-qd32", Round: 1, IOPS: 4000, CPUusPerIO: 170, ClientCPUusPerIO: 24, BoxCPUusPerIO: 250},
	}
	servers := []server{{Name: "librbd-direct"}, {Name: "rbd-nbd-go"}, {Name: "qemu-nbd"}}
	svg := chart(summarize(samples, []string{"randread-4k-qd32"}, servers, "librbd-direct", "rbd-nbd-go"))
	re := regexp.MustCompile(`height="([0-9.]+)" fill="[^"]+"><title>(\S+) \S+: ([0-9.]+)×</title>`)
	var box map[string]float64 // the second panel's bar heights
	panel := 0
	for _, m := range re.FindAllStringSubmatch(svg, -1) {
		if m[2] == "librbd-direct" {
			panel++
			if panel == 2 {
				box = map[string]float64{}
			}
		}
		if panel == 2 {
			h, _ := strconv.ParseFloat(m[1], 64)
			box[m[2]] = h
			if m[2] == "qemu-nbd" && m[3] != "5.00" {
				t.Errorf("clipped bar's tooltip %s×, want the true 5.00×", m[3])
			}
		}
	}
	if box == nil {
		t.Fatal("no box CPU panel")
	}
	if want := box["librbd-direct"] * 3; math.Abs(box["qemu-nbd"]-want) > 0.2 {
		t.Errorf("5x bar %.1f px high, want it clipped at 3x (%.1f px)", box["qemu-nbd"], want)
	}
	if !strings.Contains(svg, `fill="white">5.00</text>`) {
		t.Error("clipped bar's label is not inside it")
	}
}
