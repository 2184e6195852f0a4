package daemon

import (
	"os"
	"testing"
	"time"
)

// TestProcessAge: this test process started before now, and not long ago;
// init (pid 1) started before it.
func TestProcessAge(t *testing.T) {
	self, ok := ProcessAge(os.Getpid())
	if !ok || self < 0 || self > time.Hour {
		t.Fatalf("our own age: %s, %v", self, ok)
	}
	if initAge, ok := ProcessAge(1); ok && initAge < self {
		t.Fatalf("pid 1 is %s old, younger than us (%s)", initAge, self)
	}
	if _, ok := ProcessAge(-1); ok {
		t.Fatal("an age for no process")
	}
}
