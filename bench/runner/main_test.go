package main

import (
	"testing"
	"time"
)

// The box's busy time must follow this process's own CPU use, or the
// report's box columns would mean nothing.
func TestBoxCPUCountsBusyTime(t *testing.T) {
	a, err := boxCPU()
	if err != nil {
		t.Fatal(err)
	}
	for end := time.Now().Add(200 * time.Millisecond); time.Now().Before(end); {
	}
	b, err := boxCPU()
	if err != nil {
		t.Fatal(err)
	}
	if busy := b.busy - a.busy; busy < 0.1 {
		t.Errorf("box busy time grew %.2f s over 0.2 s of spinning", busy)
	}
	// One tick of slack: on a saturated box the counters are sampled a
	// tick apart and iowait may even step back.
	if b.all-a.all < b.busy-a.busy-0.02 {
		t.Errorf("all time %.2f s < busy time %.2f s", b.all-a.all, b.busy-a.busy)
	}
}
