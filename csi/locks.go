package csi

import (
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// keyLocks serialise calls per volume (or per name for CreateVolume): a
// second call for a key while one is in flight gets Aborted at once, as
// the CSI spec asks, and the CO retries it later.
type keyLocks struct {
	mu   sync.Mutex
	held map[string]bool
}

func newKeyLocks() *keyLocks { return &keyLocks{held: map[string]bool{}} }

// acquire takes key or returns Aborted; release with the returned func.
func (l *keyLocks) acquire(key string) (func(), error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.held[key] {
		return nil, status.Errorf(codes.Aborted, "an operation on %q is already in progress", key)
	}
	l.held[key] = true
	return func() {
		l.mu.Lock()
		delete(l.held, key)
		l.mu.Unlock()
	}, nil
}
