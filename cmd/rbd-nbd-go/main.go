// Command rbd-nbd-go serves block devices over NBD: to userspace clients on
// unix/TCP sockets (serve), and to the kernel's nbd driver as /dev/nbdX
// (map, attach, ...), with a command line compatible with Ceph's rbd-nbd.
package main

import (
	"errors"
	"fmt"
	"os"

	"github.com/spf13/cobra"
)

// exitError carries a specific exit status and a message printed verbatim
// (some callers match the exact text, e.g. ceph-csi's "not mapped").
type exitError struct {
	code int
	msg  string
}

func (e *exitError) Error() string { return e.msg }

// Exit statuses besides 0 and 1 (any other failure).
const exitNotMapped = 3

func main() {
	if err := newRoot().Execute(); err != nil {
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

func newRoot() *cobra.Command {
	root := &cobra.Command{
		Use:           "rbd-nbd-go",
		Short:         "Userspace NBD server for Ceph RBD and local devices",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	g := &globalOpts{}
	addGlobalFlags(root.PersistentFlags(), g)
	root.AddCommand(newServe(g), newMap(g), newAttach(g), newUnmap(g), newDetach(g), newListMapped(g), newDaemon(g))
	return root
}
