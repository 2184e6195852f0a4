// Package iostat turns two readings of the node daemon's device counters
// into per-interval rates and latencies, in the manner of iostat -x:
// what rbd-nbd-go iostat prints.
package iostat

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/control"
	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
)

// Row is one device over one interval.
type Row struct {
	Device string `json:"device"`
	Spec   string `json:"spec"`
	Read   Op     `json:"read"`
	Write  Op     `json:"write"`
	// Flush and Discard (TRIM and WRITE_ZEROES) per second.
	Flush   float64 `json:"flush_s"`
	Discard float64 `json:"discard_s"`
	// InFlight is the requests in librbd at the end of the interval.
	InFlight int64 `json:"in_flight"`
	// Conns is the connections served now, of Want the device has.
	Conns int64 `json:"conns"`
	Want  int   `json:"conns_want"`
	// Errors per second, of any errno.
	Errors float64 `json:"errors_s"`
}

// Op is one command's figures over an interval. Await is the mean time
// from reading a request to its completion; the percentiles are of its
// time in librbd (the histograms are kept apart), interpolated within
// their buckets.
type Op struct {
	IOPS  float64 `json:"iops"`
	MiBs  float64 `json:"mib_s"`
	Await Millis  `json:"await_ms"`
	P50   Millis  `json:"p50_ms"`
	P99   Millis  `json:"p99_ms"`
}

// Millis is a duration that prints, and encodes, as milliseconds.
type Millis time.Duration

func (m Millis) MarshalJSON() ([]byte, error) {
	return []byte(fmt.Sprintf("%.3f", float64(m)/1e6)), nil
}

func (m Millis) String() string { return fmt.Sprintf("%.2f", float64(m)/1e6) }

// Rows compares cur with prev, dt apart, for the devices of cur (a device
// new since prev counts from zero). Detached devices are left out.
func Rows(prev, cur []control.DeviceStats, dt time.Duration) []Row {
	old := map[int]nbd.Snapshot{}
	for _, d := range prev {
		old[d.Record.Index] = d.Stats
	}
	secs := dt.Seconds()
	var out []Row
	for _, d := range cur {
		if d.Record.Detached {
			continue
		}
		p := old[d.Record.Index]
		// A device unmapped and mapped again in between starts over.
		if d.Record.Spec != specOf(prev, d.Record.Index) {
			p = nbd.Snapshot{}
		}
		r := Row{Device: d.Record.Device(), Spec: d.Record.Spec, InFlight: d.Stats.InFlight,
			Conns: d.Stats.Conns, Want: d.Record.Connections}
		r.Read = op(d.Stats.Ops["read"], p.Ops["read"], secs)
		r.Write = op(d.Stats.Ops["write"], p.Ops["write"], secs)
		r.Flush = rate(d.Stats.Ops["flush"].Requests, p.Ops["flush"].Requests, secs)
		r.Discard = rate(d.Stats.Ops["trim"].Requests+d.Stats.Ops["write-zeroes"].Requests,
			p.Ops["trim"].Requests+p.Ops["write-zeroes"].Requests, secs)
		var e, pe uint64
		for _, n := range d.Stats.Errors {
			e += n
		}
		for _, n := range p.Errors {
			pe += n
		}
		r.Errors = rate(e, pe, secs)
		out = append(out, r)
	}
	return out
}

func specOf(ds []control.DeviceStats, index int) string {
	for _, d := range ds {
		if d.Record.Index == index {
			return d.Record.Spec
		}
	}
	return ""
}

func rate(cur, prev uint64, secs float64) float64 {
	if cur < prev || secs <= 0 {
		return 0
	}
	return float64(cur-prev) / secs
}

func op(cur, prev nbd.OpSnapshot, secs float64) Op {
	o := Op{IOPS: rate(cur.Requests, prev.Requests, secs), MiBs: rate(cur.Bytes, prev.Bytes, secs) / (1 << 20)}
	if cur.Requests < prev.Requests {
		return o
	}
	q, b := cur.Queued.Sub(prev.Queued), cur.Backend.Sub(prev.Backend)
	if n := q.Count(); n > 0 {
		o.Await = Millis((q.Sum + b.Sum) / time.Duration(n))
	}
	o.P50, o.P99 = Millis(b.Quantile(0.5)), Millis(b.Quantile(0.99))
	return o
}

// Write prints rows as a table, a header first.
func Write(w io.Writer, at time.Time, rows []Row) error {
	fmt.Fprintln(w, at.Format(time.TimeOnly))
	tw := tabwriter.NewWriter(w, 0, 8, 1, ' ', tabwriter.AlignRight)
	cols := []string{"device", "r/s", "rMiB/s", "r_await", "r_p50", "r_p99", "w/s", "wMiB/s", "w_await",
		"w_p50", "w_p99", "f/s", "d/s", "inflight", "conns", "err/s"}
	fmt.Fprintln(tw, strings.Join(cols, "\t")+"\t")
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%.1f\t%.2f\t%s\t%s\t%s\t%.1f\t%.2f\t%s\t%s\t%s\t%.1f\t%.1f\t%d\t%d/%d\t%.1f\t\n",
			strings.TrimPrefix(r.Device, "/dev/"), r.Read.IOPS, r.Read.MiBs, r.Read.Await, r.Read.P50, r.Read.P99,
			r.Write.IOPS, r.Write.MiBs, r.Write.Await, r.Write.P50, r.Write.P99, r.Flush, r.Discard,
			r.InFlight, r.Conns, r.Want, r.Errors)
	}
	fmt.Fprintln(tw)
	return tw.Flush()
}
