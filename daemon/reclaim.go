package daemon

import (
	"log/slog"

	"golang.org/x/sys/unix"

	"github.com/rbd-nbd-go/rbd-nbd-go/control"
)

// protectFromReclaim keeps the daemon from deadlocking under memory
// pressure: its own allocations must not wait on writeback to the devices
// it serves (PR_SET_IO_FLUSHER), and its pages must not be swapped out
// (mlockall; MCL_ONFAULT so address space reserved by Go and librados
// costs nothing until touched).
//
// PR_SET_IO_FLUSHER marks only the calling thread, and Go's threads (and
// librbd's) come from many places; but the mark is inherited by new
// threads and kept across exec. So the client that starts the daemon
// sets it on the thread that forks it (control's startFlusher), and
// every daemon thread is born with it. Here we only check, and mark this
// thread for daemons started by other means.
func protectFromReclaim(log *slog.Logger) {
	if on, _ := unix.PrctlRetInt(control.PrGetIOFlusher, 0, 0, 0, 0); on != 1 {
		log.Warn("started without PR_SET_IO_FLUSHER: only some threads get it")
		if err := unix.Prctl(control.PrSetIOFlusher, 1, 0, 0, 0); err != nil {
			log.Warn("PR_SET_IO_FLUSHER failed", "err", err)
		}
	}
	if err := unix.Mlockall(unix.MCL_CURRENT | unix.MCL_FUTURE | unix.MCL_ONFAULT); err != nil {
		log.Warn("mlockall failed", "err", err)
	}
}
