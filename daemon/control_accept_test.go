package daemon

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// flakyListener fails its first Accepts as a process out of descriptors
// would, then closes.
type flakyListener struct {
	net.Listener
	fails, calls atomic.Int32
}

func (f *flakyListener) Accept() (net.Conn, error) {
	if f.calls.Add(1) <= f.fails.Load() {
		return nil, &net.OpError{Op: "accept", Net: "unix", Err: syscall.EMFILE}
	}
	return nil, net.ErrClosed
}

// TestServeSurvivesAcceptErrors: an accept that fails for want of
// descriptors must not stop the daemon (its devices would lose their
// server); a closed listener still ends serve.
func TestServeSurvivesAcceptErrors(t *testing.T) {
	l := &flakyListener{}
	l.fails.Store(3)
	done := make(chan error, 1)
	go func() { done <- serve(context.Background(), l, nil, slog.New(slog.DiscardHandler), nil, nil, "") }()
	select {
	case err := <-done:
		if !errors.Is(err, net.ErrClosed) {
			t.Fatalf("serve: %v, want it to end only on the closed listener", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("serve did not end on a closed listener")
	}
	if n := l.calls.Load(); n != 4 {
		t.Errorf("accepted %d times, want 3 failures retried, then the close", n)
	}
}
