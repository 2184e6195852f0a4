package attach

import (
	"reflect"
	"sync"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/control"
)

// Prepared holds backends a new daemon opened ahead of a handover, while
// the old daemon still served their devices: opened, but without their
// exclusive locks or quiesce watches (backend.Options.Deferred). Only
// the locks then change hands in the pause, instead of whole opens (a
// cluster connection and a few round trips per image): the pause is what
// the application waits through.
type Prepared struct {
	mu   sync.Mutex
	devs map[int]prepared
}

type prepared struct {
	d *device
	s *served
}

// Prepare opens recs' backends, deferred, adoptWidth at a time. A
// backend that does not open is left out: Adopt opens it the usual way.
func (m *Manager) Prepare(recs []control.Record) *Prepared {
	p := &Prepared{devs: map[int]prepared{}}
	var todo []control.Record
	for _, rec := range recs {
		if !rec.Detached {
			todo = append(todo, rec)
		}
	}
	fanOut(len(todo), func(i int) {
		rec := todo[i]
		t0 := time.Now()
		d, s, err := m.openServed(rec, true)
		if err != nil {
			m.log.Warn("not opened ahead of the handover", "device", rec.Device(), "err", err)
			return
		}
		m.log.Info("opened ahead of the handover", "device", rec.Device(), "spec", rec.Spec,
			"took", time.Since(t0).Round(time.Millisecond))
		p.mu.Lock()
		p.devs[rec.Index] = prepared{d, s}
		p.mu.Unlock()
	})
	return p
}

// take hands out the backend prepared for rec, if it is still the same
// device (an unmap and map between the two steps would not be).
func (p *Prepared) take(rec control.Record) (*device, *served) {
	if p == nil {
		return nil, nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	pr, ok := p.devs[rec.Index]
	if !ok {
		return nil, nil
	}
	delete(p.devs, rec.Index)
	a, b := pr.d.rec, rec
	a.Encryption.Passphrase, b.Encryption.Passphrase = "", ""
	if !reflect.DeepEqual(a, b) {
		pr.s.stop(5 * time.Second)
		return nil, nil
	}
	return pr.d, pr.s
}

// Close closes what Adopt did not take.
func (p *Prepared) Close() {
	if p == nil {
		return
	}
	p.mu.Lock()
	devs := p.devs
	p.devs = map[int]prepared{}
	p.mu.Unlock()
	for _, pr := range devs {
		pr.s.stop(5 * time.Second)
	}
}
