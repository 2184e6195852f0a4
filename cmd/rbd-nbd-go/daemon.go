package main

import (
	"context"
	"fmt"
	"io"
	"math"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/rbd-nbd-go/rbd-nbd-go/control"
	"github.com/rbd-nbd-go/rbd-nbd-go/daemon"
	"github.com/rbd-nbd-go/rbd-nbd-go/devspec"
	"github.com/rbd-nbd-go/rbd-nbd-go/kernel"
	"github.com/rbd-nbd-go/rbd-nbd-go/metrics"
	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
)

// newDaemon is the node daemon's hidden command (control.Client starts
// it); the daemon itself lives in package daemon.
func newDaemon(g *globalOpts, procs int) *cobra.Command {
	var mod kernel.ModuleOptions
	readyFD := -1
	takeOver := false
	budget := os.Getenv(memoryBudgetEnv)
	if budget == "" {
		budget = "512M"
	}
	metricsAddr := os.Getenv(metricsAddressEnv)
	cmd := &cobra.Command{
		Use:    "daemon",
		Short:  "Serve this node's NBD devices (started by map/attach on first use)",
		Args:   cobra.NoArgs,
		Hidden: true,
		RunE: func(cmd *cobra.Command, args []string) error {
			var ready io.WriteCloser
			if readyFD >= 0 {
				ready = os.NewFile(uintptr(readyFD), "ready")
			}
			b, err := devspec.ParseSize(budget)
			if err != nil || b < nbd.MaxPayload || b > math.MaxInt64/2 {
				// Under one request's worth, the budget would only
				// serialise every connection to one request at a time.
				err := fmt.Errorf("memory budget %q: want a size of at least 32M, like 512M or 2G", budget)
				if ready != nil {
					fmt.Fprintln(ready, err) // the starter reports it
				}
				return err
			}
			if metricsAddr != "" {
				if _, err := metrics.Address(metricsAddr); err != nil {
					if ready != nil {
						fmt.Fprintln(ready, err)
					}
					return err
				}
			}
			ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
			defer stop()
			signal.Ignore(syscall.SIGHUP, syscall.SIGPIPE)
			err = daemon.Run(ctx, daemon.Config{StateDir: g.stateDir, Module: mod, Log: logger(g.logLevel),
				Ready: ready, MemoryBudget: int(b), IdleProcs: procs, TakeOver: takeOver, MetricsAddress: metricsAddr,
				// Test and development hooks.
				KernelInterface: os.Getenv("RBD_NBD_GO_KERNEL_INTERFACE"),
				CPUProfile:      os.Getenv("RBD_NBD_GO_CPU_PROFILE")})
			if err != nil {
				return &exitError{code: 1} // logged, and told to the starter
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.IntVar(&mod.NbdsMax, "nbds_max", 0, "nbd module parameter, if the daemon loads the module")
	f.IntVar(&mod.MaxPart, "max_part", 0, "nbd module parameter, if the daemon loads the module")
	f.IntVar(&readyFD, "ready-fd", -1, "write \"ok\" (or the error) here once serving")
	f.BoolVar(&takeOver, "take-over", false, "if a daemon serves the state directory, take its devices over (an upgrade)")
	f.StringVar(&budget, "memory-budget", budget,
		"payload memory that requests may hold in flight over all devices (default $"+memoryBudgetEnv+" or 512M; a daemon started on demand inherits the environment)")
	f.StringVar(&metricsAddr, "metrics-address", metricsAddr,
		"serve Prometheus metrics of every device on HOST:PORT or PORT (loopback unless a host is given; default $"+metricsAddressEnv+", else off)")
	return cmd
}

// metricsAddressEnv sets the daemon's --metrics-address, inherited as
// memoryBudgetEnv is.
const metricsAddressEnv = "RBD_NBD_GO_METRICS_ADDRESS"

// memoryBudgetEnv sets the daemon's --memory-budget: the daemon is
// started on demand by whichever command first needs it, and inherits
// that command's environment.
const memoryBudgetEnv = "RBD_NBD_GO_MEMORY_BUDGET"

// client is the node daemon's control client for this command line.
func (g *globalOpts) client(nbdsMax, maxPart int) *control.Client {
	return &control.Client{StateDir: g.stateDir, Start: control.StartOptions{LogLevel: g.logLevel,
		NbdsMax: nbdsMax, MaxPart: maxPart}}
}
