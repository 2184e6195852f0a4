package attach

import (
	"sort"

	"github.com/rbd-nbd-go/rbd-nbd-go/control"
	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
)

// DeviceStats is one device's counters, for metrics and iostat.
type DeviceStats struct {
	// Rec is the device's record without its secrets.
	Rec   control.Record
	Stats nbd.Snapshot
}

// Stats reads every device's counters, in device order. It takes only
// the manager's lock, never a device's: a scrape must not wait behind a
// reattach.
func (m *Manager) Stats() []DeviceStats {
	type one struct {
		rec control.Record
		st  *nbd.Stats
	}
	m.mu.Lock()
	devs := make([]one, 0, len(m.devs))
	for _, d := range m.devs {
		devs = append(devs, one{d.rec.Public(), d.stats})
	}
	m.mu.Unlock()
	out := make([]DeviceStats, 0, len(devs))
	for _, d := range devs {
		ds := DeviceStats{Rec: d.rec}
		if d.st != nil {
			ds.Stats = d.st.Snapshot()
		}
		out = append(out, ds)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Rec.Index < out[j].Rec.Index })
	return out
}
