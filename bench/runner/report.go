package main

import (
	"fmt"
	"slices"
	"strings"
)

// cell is the median over rounds of one server on one job.
type cell struct {
	IOPS, MiBps, P99us, CPUusPerIO, ClientCPUusPerIO float64
	BoxCPUusPerIO, BoxBusy                           float64
}

// A measure is one figure of a cell that the report compares with the
// baseline's: the ratios table and the chart both take it from here.
type measure struct {
	title string // the chart panel's, before "relative to <baseline>"
	val   func(cell) float64
}

var (
	iopsMeasure      = measure{"IOPS", func(c cell) float64 { return c.IOPS }}
	serverCPUMeasure = measure{"Server CPU per I/O", func(c cell) float64 { return c.CPUusPerIO }}
	// fio+server is all a contender costs the client machine, whichever
	// process pays: for direct librbd, fio's CPU is all of librbd's work.
	// It is 0 for results saved before fio's CPU was measured, so that no
	// ratio is taken of the server's CPU alone under this name.
	fioServerCPUMeasure = measure{"fio+server CPU per I/O", func(c cell) float64 {
		if c.ClientCPUusPerIO == 0 {
			return 0
		}
		return c.CPUusPerIO + c.ClientCPUusPerIO
	}}
	boxCPUMeasure = measure{"Whole box's CPU per I/O (fio, server, OSD, kernel)",
		func(c cell) float64 { return c.BoxCPUusPerIO }}
)

// ratio is s's figure over the baseline b's, or 0 where b has none (no
// server process, or a figure not measured when the results were saved).
func (m measure) ratio(s, b cell) float64 {
	if bv := m.val(b); bv > 0 {
		return m.val(s) / bv
	}
	return 0
}

type jobSummary struct {
	Job     string          `json:"job"`
	Servers map[string]cell `json:"servers"`
	// Ratios of the subject to the baseline: IOPS (higher is better) and
	// server CPU per I/O (lower is better).
	IOPSRatio float64 `json:"iops_ratio"`
	CPURatio  float64 `json:"cpu_per_io_ratio"`
	// TotalCPURatio compares fio+server CPU per I/O: the whole cost on
	// the client machine, whichever process pays it.
	TotalCPURatio float64 `json:"total_cpu_per_io_ratio"`
	// BoxCPURatio compares the whole box's CPU per I/O (the OSD's
	// included): with the box saturated, IOPS ratio ≈ 1 / BoxCPURatio.
	BoxCPURatio float64 `json:"box_cpu_per_io_ratio"`
	// RoundRatios are the subject's IOPS over the baseline's in each
	// round (the two ran minutes apart at most): their spread is the
	// box's noise, shown beside the ratio of medians.
	RoundRatios []float64 `json:"round_iops_ratios"`
	// Peer holds the subject's ratios to the report's peer, if it ran.
	Peer *peerRatios `json:"peer_ratios,omitempty"`
}

// peerRatios compare the subject with another NBD server behind the same
// client: what is left over there is the cost of the design, not of the
// NBD hop that any server in front of librbd pays.
type peerRatios struct {
	IOPS         float64 `json:"iops_ratio"`
	ServerCPU    float64 `json:"cpu_per_io_ratio"`
	FioServerCPU float64 `json:"total_cpu_per_io_ratio"`
	BoxCPU       float64 `json:"box_cpu_per_io_ratio"`
	// RoundBoxCPU is the subject's box CPU per I/O over the peer's in
	// each round: the spread shows how far the medians can be trusted.
	RoundBoxCPU []float64 `json:"round_box_cpu_ratios"`
}

type report struct {
	Targets  map[string]target `json:"targets"`
	Baseline string            `json:"baseline"`
	Peer     string            `json:"peer,omitempty"`
	Subject  string            `json:"subject"`
	Servers  []string          `json:"servers"`
	Jobs     []jobSummary      `json:"jobs"`
}

func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	if n := len(s); n%2 == 1 {
		return s[n/2]
	} else {
		return (s[n/2-1] + s[n/2]) / 2
	}
}

func summarize(samples []sample, jobs []string, servers []server, baseline, subject string) report {
	r := report{Baseline: baseline, Subject: subject}
	for _, s := range servers {
		r.Servers = append(r.Servers, s.Name)
	}
	for _, job := range jobs {
		js := jobSummary{Job: job, Servers: map[string]cell{}}
		for _, srv := range r.Servers {
			var iops, mib, p99, cpu, client, box, busy []float64
			for _, s := range samples {
				if s.Job == job && s.Server == srv {
					iops, mib = append(iops, s.IOPS), append(mib, s.MiBps)
					p99, cpu = append(p99, s.P99us), append(cpu, s.CPUusPerIO)
					client = append(client, s.ClientCPUusPerIO)
					box, busy = append(box, s.BoxCPUusPerIO), append(busy, s.BoxBusy)
				}
			}
			js.Servers[srv] = cell{median(iops), median(mib), median(p99), median(cpu), median(client),
				median(box), median(busy)}
		}
		js.RoundRatios = roundRatios(samples, job, baseline, subject, func(s sample) float64 { return s.IOPS })
		s, b := js.Servers[subject], js.Servers[baseline]
		js.IOPSRatio = iopsMeasure.ratio(s, b)
		js.CPURatio = serverCPUMeasure.ratio(s, b)
		js.TotalCPURatio = fioServerCPUMeasure.ratio(s, b)
		js.BoxCPURatio = boxCPUMeasure.ratio(s, b)
		r.Jobs = append(r.Jobs, js)
	}
	return r
}

// addPeer sets every job's ratios of the subject to peer, where the
// peer ran.
func (r *report) addPeer(samples []sample, peer string) {
	if peer == "" || !slices.Contains(r.Servers, peer) {
		return
	}
	r.Peer = peer
	for i := range r.Jobs {
		j := &r.Jobs[i]
		s, p := j.Servers[r.Subject], j.Servers[peer]
		if p.IOPS == 0 {
			continue
		}
		j.Peer = &peerRatios{IOPS: iopsMeasure.ratio(s, p), ServerCPU: serverCPUMeasure.ratio(s, p),
			FioServerCPU: fioServerCPUMeasure.ratio(s, p), BoxCPU: boxCPUMeasure.ratio(s, p)}
		j.Peer.RoundBoxCPU = roundRatios(samples, j.Job, peer, r.Subject,
			func(s sample) float64 { return s.BoxCPUusPerIO })
	}
}

// roundRatios pairs subject's and other's samples of job by round and
// gives subject's figure (val) over other's in each.
func roundRatios(samples []sample, job, other, subject string, val func(sample) float64) []float64 {
	base := map[int]float64{}
	for _, s := range samples {
		if s.Job == job && s.Server == other && val(s) > 0 {
			base[s.Round] = val(s)
		}
	}
	var out []float64
	for _, s := range samples {
		if b, ok := base[s.Round]; ok && s.Job == job && s.Server == subject {
			out = append(out, val(s)/b)
		}
	}
	return out
}

func markdown(r report, title string, runtime, rounds int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "# Benchmark\n\n%s; %d s per job, median of %d rounds (order alternating). "+
		"Ratios: %s ÷ %s.\n\n", title, runtime, rounds, r.Subject, r.Baseline)
	b.WriteString("| job | server | IOPS | MiB/s | p99 µs | server CPU µs/IO | fio CPU µs/IO | fio+server µs/IO | box CPU µs/IO | box busy |\n" +
		"|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, j := range r.Jobs {
		for _, srv := range r.Servers {
			c := j.Servers[srv]
			fmt.Fprintf(&b, "| %s | %s | %.0f | %.1f | %.0f | %.2f | %.2f | %.2f | %s |\n", j.Job, srv, c.IOPS, c.MiBps,
				c.P99us, c.CPUusPerIO, c.ClientCPUusPerIO, fioServerCPUMeasure.val(c), boxCells(c))
		}
	}
	b.WriteString("\n## Ratios and targets\n\n| job | IOPS ratio | CPU/IO ratio | fio+server CPU/IO ratio | box CPU/IO ratio | target | others' IOPS ratios |\n" +
		"|---|---:|---:|---:|---:|---|---|\n")
	for _, j := range r.Jobs {
		verdict := "—"
		if t, ok := r.Targets[j.Job]; ok {
			met := j.IOPSRatio >= t.MinIOPS
			want := fmt.Sprintf("IOPS ≥ %.2f×", t.MinIOPS)
			if t.MaxCPU > 0 {
				met = met && j.CPURatio <= t.MaxCPU
				want += fmt.Sprintf(", CPU ≤ %.2f×", t.MaxCPU)
			}
			verdict = map[bool]string{true: "met", false: "MISSED"}[met] + " (" + want + ")"
		}
		var others []string
		if base := j.Servers[r.Baseline]; base.IOPS > 0 {
			for _, srv := range r.Servers {
				if srv != r.Baseline && srv != r.Subject {
					others = append(others, fmt.Sprintf("%s %.2f×", srv, iopsMeasure.ratio(j.Servers[srv], base)))
				}
			}
		}
		ratio := fmt.Sprintf("%.2f×", j.IOPSRatio)
		if len(j.RoundRatios) > 1 {
			ratio += fmt.Sprintf(" (rounds %.2f–%.2f)", slices.Min(j.RoundRatios), slices.Max(j.RoundRatios))
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s | %s |\n", j.Job, ratio, ratioCell(j.CPURatio),
			ratioCell(j.TotalCPURatio), ratioCell(j.BoxCPURatio), verdict, strings.Join(others, ", "))
	}
	if r.Peer != "" {
		fmt.Fprintf(&b, "\n## Against the NBD peer\n\n%s ÷ %s: the same fio client and librbd, another NBD server.\n\n"+
			"| job | IOPS ratio | server CPU/IO ratio | fio+server CPU/IO ratio | box CPU/IO ratio | box ratio by round |\n"+
			"|---|---:|---:|---:|---:|---|\n", r.Subject, r.Peer)
		for _, j := range r.Jobs {
			if p := j.Peer; p != nil {
				rounds := "—"
				if len(p.RoundBoxCPU) > 0 {
					rounds = fmt.Sprintf("median %.2f× (%.2f–%.2f)", median(p.RoundBoxCPU),
						slices.Min(p.RoundBoxCPU), slices.Max(p.RoundBoxCPU))
				}
				fmt.Fprintf(&b, "| %s | %.2f× | %s | %s | %s | %s |\n", j.Job, p.IOPS, ratioCell(p.ServerCPU),
					ratioCell(p.FioServerCPU), ratioCell(p.BoxCPU), rounds)
			}
		}
	}
	return b.String()
}

// boxCells prints the box's CPU per I/O and busy share, or dashes for a
// run saved before they were measured.
func boxCells(c cell) string {
	if c.BoxCPUusPerIO == 0 {
		return "— | —"
	}
	return fmt.Sprintf("%.2f | %.0f%%", c.BoxCPUusPerIO, 100*c.BoxBusy)
}

// ratioCell prints a CPU ratio, or a dash where there is none (a
// baseline without a server process, or without fio's CPU measured).
func ratioCell(v float64) string {
	if v > 0 {
		return fmt.Sprintf("%.2f×", v)
	}
	return "—"
}

// cpuMeasures picks the chart's CPU panels. Where the baseline has a
// server process (nbdkit) the panel is the server's CPU per I/O, as it
// always was. Where it has none (direct librbd: all of librbd's work is
// fio's) that panel would be all zeros, so the chart shows what the
// ratios table compares instead: the whole box's CPU per I/O, which
// bounds IOPS when the box is saturated, and fio+server's; each only if
// the baseline has it (results saved before it was measured do not).
func cpuMeasures(r report) []measure {
	if baselineHas(r, serverCPUMeasure) {
		return []measure{serverCPUMeasure}
	}
	var ms []measure
	for _, m := range []measure{boxCPUMeasure, fioServerCPUMeasure} {
		if baselineHas(r, m) {
			ms = append(ms, m)
		}
	}
	return ms
}

// baselineHas reports whether the baseline has a figure for m in any job.
func baselineHas(r report, m measure) bool {
	for _, j := range r.Jobs {
		if m.val(j.Servers[r.Baseline]) > 0 {
			return true
		}
	}
	return false
}

// chart draws one panel of grouped bars for IOPS and one for each of
// cpuMeasures, every bar normalised to the baseline (the dashed line at
// 1.0).
func chart(r report) string {
	const (
		w, panelH, top, left, gap = 900, 260, 40, 60, 24
		maxShown                  = 3.0 // ratio at a panel's top, at most
	)
	colors := []string{"#2b6cb0", "#dd6b20", "#718096", "#38a169", "#805ad5", "#d53f8c", "#319795"}
	groupW := (w - left - 30) / max(1, len(r.Jobs))
	barW := (groupW - gap) / max(1, len(r.Servers))
	legendW := min(160, (w-left-20)/max(1, len(r.Servers)))
	type panel struct {
		measure
		better string
	}
	panels := []panel{{iopsMeasure, "higher"}}
	for _, m := range cpuMeasures(r) {
		panels = append(panels, panel{m, "lower"})
	}
	var b strings.Builder
	h := len(panels)*(panelH+top+20) + 40
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="11">`+"\n", w, h)
	b.WriteString(`<rect width="100%" height="100%" fill="white"/>` + "\n")
	for p, panel := range panels {
		y0 := top + p*(panelH+top+20)
		maxV := 1.5
		for _, j := range r.Jobs {
			for _, s := range r.Servers {
				maxV = max(maxV, panel.ratio(j.Servers[s], j.Servers[r.Baseline])*1.1)
			}
		}
		// One far outlier (qemu-nbd's reads, 5-6x) would flatten every
		// other bar: past maxShown a bar stops at the top, its label
		// still the true ratio.
		maxV = min(maxV, maxShown)
		scale := float64(panelH) / maxV
		fmt.Fprintf(&b, `<text x="%d" y="%d" font-size="13" font-weight="bold">%s relative to %s (%s is better)</text>`+"\n",
			left, y0-10, panel.title, r.Baseline, panel.better)
		fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>`+"\n", left, y0+panelH, w-20, y0+panelH)
		oneY := float64(y0+panelH) - scale
		fmt.Fprintf(&b, `<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#444" stroke-dasharray="4 3"/>`+"\n", left, oneY, w-20, oneY)
		fmt.Fprintf(&b, `<text x="%d" y="%.1f" text-anchor="end">1.0×</text>`+"\n", left-5, oneY+4)
		for i, j := range r.Jobs {
			x := left + 10 + i*groupW
			for k, s := range r.Servers {
				v := panel.ratio(j.Servers[s], j.Servers[r.Baseline])
				bh := min(v, maxV) * scale
				fmt.Fprintf(&b, `<rect x="%d" y="%.1f" width="%d" height="%.1f" fill="%s"><title>%s %s: %.2f×</title></rect>`+"\n",
					x+k*barW, float64(y0+panelH)-bh, barW-2, bh, colors[k%len(colors)], s, j.Job, v)
				ly, fill := float64(y0+panelH)-bh-3, "black"
				if v > maxV { // clipped: the label goes inside the bar's top
					ly, fill = float64(y0)+12, "white"
				}
				fmt.Fprintf(&b, `<text x="%d" y="%.1f" font-size="9" text-anchor="middle" fill="%s">%.2f</text>`+"\n",
					x+k*barW+barW/2, ly, fill, v)
			}
			fmt.Fprintf(&b, `<text x="%d" y="%d" text-anchor="middle">%s</text>`+"\n", x+len(r.Servers)*barW/2, y0+panelH+14, j.Job)
		}
	}
	ly := h - 20
	for k, s := range r.Servers {
		fmt.Fprintf(&b, `<rect x="%d" y="%d" width="12" height="12" fill="%s"/><text x="%d" y="%d">%s</text>`+"\n",
			left+k*legendW, ly-10, colors[k%len(colors)], left+k*legendW+16, ly, s)
	}
	b.WriteString("</svg>\n")
	return b.String()
}
