package csi

import (
	"context"
	"errors"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
	"github.com/rbd-nbd-go/rbd-nbd-go/control"
)

// cephStatus turns an error from image management or the node daemon
// into a gRPC status with the right code. Messages come from rbdio and
// the daemon, which never put a key in an error.
func cephStatus(err error, what string) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		// Not final: the CO retries, and treats the operation as maybe
		// done.
		return status.FromContextError(err).Err()
	}
	c := codes.Internal
	var uc errUnknownCluster
	switch {
	case errors.As(err, &uc), errors.Is(err, errNoCredentials), errors.Is(err, errBadCapability):
		c = codes.InvalidArgument
	case errors.Is(err, ceph.ErrImageNotFound), errors.Is(err, ceph.ErrPoolNotFound):
		c = codes.NotFound
	case errors.Is(err, ceph.ErrPermission), errors.Is(err, ceph.ErrBadPassphrase):
		c = codes.PermissionDenied
	case errors.Is(err, ceph.ErrUnreachable), errors.Is(err, control.ErrHandingOver):
		c = codes.Unavailable
	case errors.Is(err, ceph.ErrImageInUse), errors.Is(err, control.ErrBusy), errors.Is(err, ceph.ErrLocked):
		c = codes.FailedPrecondition
	}
	return status.Errorf(c, "%s: %v", what, err)
}
