// Command rbd-nbd-go serves block devices over NBD: to userspace clients on
// unix/TCP sockets, and (later) to the kernel's nbd driver.
package main

import (
	"fmt"
	"os"

	"github.com/spf13/cobra"
)

func main() {
	if err := newRoot().Execute(); err != nil {
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
	root.PersistentFlags().String("log-level", "info", "log level: debug, info, warn, error")
	root.AddCommand(newServe())
	return root
}
