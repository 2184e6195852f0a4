package metrics

import (
	"encoding/json"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
)

// TestDashboard: deploy/grafana's dashboard is a Grafana dashboard whose
// queries name only series this package exports and variables it
// defines, and whose panels tile the grid without overlapping. (No
// Grafana to render it with here: Debian does not package one.)
func TestDashboard(t *testing.T) {
	b, err := os.ReadFile("../deploy/grafana/rbd-nbd-go.json")
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		UID, Title    string
		SchemaVersion int
		Templating    struct {
			List []struct{ Name, Type string }
		}
		Panels []struct {
			ID      int
			Type    string
			Title   string
			GridPos struct{ X, Y, W, H int }
			Targets []struct{ RefID, Expr string }
		}
	}
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatal(err)
	}
	if d.UID == "" || d.Title == "" || d.SchemaVersion < 30 || len(d.Panels) == 0 {
		t.Fatalf("uid %q title %q schemaVersion %d, %d panels", d.UID, d.Title, d.SchemaVersion, len(d.Panels))
	}
	exported := exportedNames(t)
	vars := map[string]bool{"__rate_interval": true, "__interval": true, "__range": true}
	for _, v := range d.Templating.List {
		vars[v.Name] = true
	}
	ids := map[int]bool{}
	used := map[[2]int]string{} // grid cell -> panel
	metric := regexp.MustCompile(`\b(rbd_nbd_[a-z_]+|csi_plugin_[a-z_]+)\b`)
	variable := regexp.MustCompile(`\$\{?(\w+)`)
	for _, p := range d.Panels {
		if ids[p.ID] {
			t.Errorf("panel id %d twice", p.ID)
		}
		ids[p.ID] = true
		g := p.GridPos
		if g.W <= 0 || g.H <= 0 || g.X < 0 || g.X+g.W > 24 {
			t.Errorf("panel %q: gridPos %+v off the 24-column grid", p.Title, g)
		}
		for x := g.X; x < g.X+g.W; x++ {
			for y := g.Y; y < g.Y+g.H; y++ {
				if o, ok := used[[2]int{x, y}]; ok {
					t.Errorf("panels %q and %q overlap at %d,%d", o, p.Title, x, y)
				}
				used[[2]int{x, y}] = p.Title
			}
		}
		if p.Type == "row" {
			continue
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, q := range p.Targets {
			if strings.Count(q.Expr, "(") != strings.Count(q.Expr, ")") || strings.Count(q.Expr, "{") != strings.Count(q.Expr, "}") {
				t.Errorf("panel %q: unbalanced query %s", p.Title, q.Expr)
			}
			names := metric.FindAllString(q.Expr, -1)
			if len(names) == 0 {
				t.Errorf("panel %q: query names no series of ours: %s", p.Title, q.Expr)
			}
			for _, n := range names {
				if !exported[n] {
					t.Errorf("panel %q: %s is not exported", p.Title, n)
				}
			}
			for _, m := range variable.FindAllStringSubmatch(q.Expr, -1) {
				if !vars[m[1]] {
					t.Errorf("panel %q: variable $%s is not defined", p.Title, m[1])
				}
			}
		}
	}
}

// exportedNames is every series name the collectors give, a histogram's
// _bucket, _sum and _count included.
func exportedNames(t *testing.T) map[string]bool {
	reg := prometheus.NewRegistry()
	// A device with every kind of series: an op with both histograms, an
	// error.
	var hs nbd.HistogramSnapshot
	hs.Counts[0] = 1
	dev := ForSpec("/dev/nbd0", "rbd/img", "", nbd.Snapshot{
		Ops:    map[string]nbd.OpSnapshot{"write": {Requests: 1, Backend: hs}},
		Errors: map[string]uint64{"EIO": 1}})
	reg.MustRegister(NewCollector(func() []Device { return []Device{dev} }))
	NewCSICalls(reg, "d").ObserveCall("/m", "OK", time.Millisecond)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]bool{}
	for _, mf := range mfs {
		n := mf.GetName()
		out[n] = true
		if mf.GetType().String() == "HISTOGRAM" {
			out[n+"_bucket"], out[n+"_sum"], out[n+"_count"] = true, true, true
		}
	}
	return out
}
