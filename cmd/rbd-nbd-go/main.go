// Command rbd-nbd-go serves block devices over NBD: to userspace clients on
// unix/TCP sockets (serve), and to the kernel's nbd driver as /dev/nbdX
// (map, attach, ...), with a command line compatible with Ceph's rbd-nbd.
package main

import (
	"errors"
	"fmt"
	"os"
	"runtime"

	"github.com/spf13/cobra"
)

// exitError carries a specific exit status and a message printed verbatim
// (some callers match the exact text, e.g. ceph-csi's "not mapped").
type exitError struct {
	code int
	msg  string
}

func (e *exitError) Error() string { return e.msg }

// version is set at build time (-ldflags "-X main.version=...").
var version = "dev"

// Exit statuses besides 0 and 1 (any other failure).
const exitNotMapped = 3

func main() {
	if err := newRoot(spareProcs()).Execute(); err != nil {
		var ee *exitError
		if errors.As(err, &ee) {
			if ee.msg != "" {
				fmt.Fprintln(os.Stderr, ee.msg)
			}
			os.Exit(ee.code)
		}
		fmt.Fprintln(os.Stderr, "rbd-nbd-go:", err)
		os.Exit(1)
	}
}

// newRoot builds the commands; procs is the scheduler's width before
// spareProcs added spares (the daemon's width when it serves nothing).
func newRoot(procs int) *cobra.Command {
	root := &cobra.Command{
		Use:           "rbd-nbd-go",
		Short:         "Userspace NBD server for Ceph RBD and local devices",
		Long:          rbdNbdUsage,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	g := &globalOpts{}
	addGlobalFlags(root.PersistentFlags(), g)
	root.AddCommand(newServe(g), newMap(g), newAttach(g), newUnmap(g), newDetach(g), newListMapped(g), newIostat(g), newDaemon(g, procs),
		newCSI(g, version), newLiveness(g))
	return root
}

// rbdNbdUsage is the top of --help. Installed as rbd-nbd, the binary is
// run by Ceph's rbd CLI and probed by ceph-csi, which decides at start
// which rbd-nbd features it may use from \`rbd-nbd --help\`: exit 0,
// nothing on stderr, and --cookie on stdout turn the nbd mounter and its
// cookies on (internal/rbd/rbd_attach.go). So the help names the
// commands and map options the way Ceph's rbd-nbd does.
const rbdNbdUsage = `Userspace NBD server for Ceph RBD and local devices; a drop-in for Ceph's rbd-nbd.

Usage: rbd-nbd-go [options] map <image-or-snap-spec>    Map image to nbd device
                  detach <device|image-or-snap-spec>    Detach image from nbd device
                  [options] attach <image-or-snap-spec> Attach image to nbd device
                  unmap <device|image-or-snap-spec>     Unmap nbd device
                  [options] list-mapped                 List mapped nbd devices
                  serve <spec>                          Serve over NBD on a socket
                  csi                                   Serve the CSI driver
Map and attach options:
  --device <device path>        Specify nbd device path (/dev/nbd{num})
  --encryption-format luks|luks1|luks2
  --encryption-passphrase-file  Path of file containing passphrase
  --exclusive                   Forbid writes by other clients
  --io-timeout <sec>            Set nbd IO timeout
  --notrim                      Turn off trim/discard
  --quiesce                     Use quiesce callbacks
  --quiesce-hook <path>         Specify quiesce hook path
  --read-only                   Map read-only
  --reattach-timeout <sec>      Set nbd re-attach timeout (default: 30)
  --try-netlink                 Use the nbd netlink interface (always tried first)
  --show-cookie                 Show device cookie
  --cookie                      Specify device cookie
  --connections <n>             Sockets (kernel queues) per device
  --resend-interval <sec>       Resend after a server restart (io-timeout 0, 1 connection)
List options:
  --format plain|json           Output format (default: plain)
  --pretty-format               Pretty formatting (json)`

// spareProcs gives the Go scheduler more Ps than CPUs, unless GOMAXPROCS
// says otherwise. Every connection keeps a goroutine blocked in read(2)
// (the sockets are off the netpoller, see nbd/wire.go) and each image a
// reaper blocked on librbd's eventfd. With no idle P, sysmon takes the P
// of every syscall that lasts over 20 µs and wakes another thread to run
// it; with one spare, a syscall keeps its P for up to 10 ms and simply
// returns to it (figures: bench/reference/vm/README.md). Spare Ps cost
// nothing while idle but for collections, so the daemon narrows back to
// the width returned here, the runtime's own choice (which counts a
// cgroup CPU limit) or GOMAXPROCS, when it serves no device.
func spareProcs() int {
	n := runtime.GOMAXPROCS(0)
	if os.Getenv("GOMAXPROCS") != "" {
		return n
	}
	runtime.GOMAXPROCS(max(2*n, n+6))
	return n
}
