package iostat

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/control"
	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
)

func dev(index int, spec string, reads, readBytes uint64, backend nbd.HistogramSnapshot) control.DeviceStats {
	r := control.Record{Index: index, Spec: spec}
	r.Connections = 2
	q := nbd.HistogramSnapshot{Sum: time.Duration(reads) * 100 * time.Microsecond}
	q.Counts[1] = reads
	return control.DeviceStats{Record: r, Stats: nbd.Snapshot{Conns: 2,
		Ops: map[string]nbd.OpSnapshot{"read": {Requests: reads, Bytes: readBytes, Queued: q, Backend: backend}}}}
}

// TestRows: rates and latencies of the interval only; a device mapped
// again in between counts from zero.
func TestRows(t *testing.T) {
	var b0, b1 nbd.HistogramSnapshot
	b0.Counts[4], b0.Sum = 100, 100*time.Millisecond // 100 at ~1 ms before
	b1 = b0
	b1.Counts[8] += 200 // 200 more in (10 ms, 25 ms]
	b1.Sum += 200 * 20 * time.Millisecond
	prev := []control.DeviceStats{dev(0, "rbd/a", 100, 100<<12, b0), dev(1, "rbd/old", 5000, 0, b0)}
	cur := []control.DeviceStats{dev(0, "rbd/a", 300, 300<<12, b1), dev(1, "rbd/new", 50, 50<<20, b0)}
	rows := Rows(prev, cur, 2*time.Second)
	if len(rows) != 2 {
		t.Fatalf("%d rows", len(rows))
	}
	r := rows[0].Read
	if r.IOPS != 100 || r.MiBs != 200.0*4096/(1<<20)/2 {
		t.Fatalf("iops %v, MiB/s %v", r.IOPS, r.MiBs)
	}
	// 200 requests, each 0.1 ms queued and 20 ms in librbd.
	if r.Await != Millis(20100*time.Microsecond) {
		t.Fatalf("await %s ms", r.Await)
	}
	if p := time.Duration(r.P50); p <= 10*time.Millisecond || p > 25*time.Millisecond {
		t.Fatalf("p50 %s: not in the interval's bucket", p)
	}
	if rows[1].Read.IOPS != 25 || rows[1].Read.MiBs != 25 {
		t.Fatalf("a device mapped again: %+v", rows[1].Read)
	}
	var out bytes.Buffer
	Write(&out, time.Unix(0, 0), rows)
	if !strings.Contains(out.String(), "nbd0") || !strings.Contains(out.String(), "2/2") {
		t.Fatalf("table:\n%s", out.String())
	}
}
