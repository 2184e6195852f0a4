package testcmd

import (
	"bytes"
	"context"
	"testing"
	"time"
)

// TestBoundReachesForkedChildren: a command whose forked child holds
// stdout open still returns at its bound, not when the child is done
// (the way fio's job processes once hung CI).
func TestBoundReachesForkedChildren(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	cmd := Command(ctx, "sh", "-c", "sleep 60 & sleep 60")
	var out bytes.Buffer
	cmd.Stdout = &out
	start := time.Now()
	err := cmd.Run()
	if err == nil || time.Since(start) > 15*time.Second {
		t.Fatalf("returned %v after %v", err, time.Since(start))
	}
}
