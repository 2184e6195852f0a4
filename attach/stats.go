package attach

import (
	"sort"

	"github.com/rbd-nbd-go/rbd-nbd-go/control"
	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
)

// Stats reads every device's counters, in device order, with its record
// stripped of secrets. It takes only the manager's lock, never a
// device's: a scrape must not wait behind a reattach.
func (m *Manager) Stats() []control.DeviceStats {
	type one struct {
		rec control.Record
		st  *nbd.Stats
		ev  *deviceEvents
	}
	m.mu.Lock()
	devs := make([]one, 0, len(m.devs))
	for _, d := range m.devs {
		devs = append(devs, one{d.rec.Public(), d.stats, d.events})
	}
	m.mu.Unlock()
	out := make([]control.DeviceStats, 0, len(devs))
	for _, d := range devs {
		ds := control.DeviceStats{Record: d.rec}
		if d.st != nil {
			ds.Stats = d.st.Snapshot()
		}
		if d.ev != nil {
			ds.Replaced, ds.Reattached, ds.Resized = d.ev.replaced.Load(), d.ev.reattached.Load(), d.ev.resized.Load()
		}
		out = append(out, ds)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Record.Index < out[j].Record.Index })
	return out
}
