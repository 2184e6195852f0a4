package progress

import (
	"bytes"
	"strings"
	"testing"
	"time"
)

func TestWaiting(t *testing.T) {
	var b bytes.Buffer
	stop := Waiting(&b, false, "mapping", 0)
	time.Sleep(50 * time.Millisecond)
	stop()
	if b.Len() != 0 {
		t.Fatalf("wrote %q to a non-terminal", b.String())
	}
	stop = Waiting(&b, true, "mapping", time.Hour)
	stop()
	if b.Len() != 0 {
		t.Fatalf("a quick call wrote %q", b.String())
	}
	stop = Waiting(&b, true, "mapping rbd/a", 10*time.Millisecond)
	time.Sleep(1100 * time.Millisecond)
	stop()
	stop() // twice is harmless
	out := b.String()
	if !strings.Contains(out, "mapping rbd/a... 0s") || !strings.Contains(out, "mapping rbd/a... 1s") || !strings.HasSuffix(out, "\r\033[K") {
		t.Fatalf("%q", out)
	}
}
