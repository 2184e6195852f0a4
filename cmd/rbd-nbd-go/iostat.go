package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/rbd-nbd-go/rbd-nbd-go/control"
	"github.com/rbd-nbd-go/rbd-nbd-go/internal/iostat"
)

func newIostat(g *globalOpts) *cobra.Command {
	var intervalArg string
	var count int
	var format string
	cmd := &cobra.Command{
		Use:   "iostat [DEV|SPEC...] [-i SECONDS] [--count N] [--format plain|json]",
		Short: "Show each device's IOPS, throughput, latency and connections, every interval",
		Long: `Show what each mapped device is doing, in the manner of iostat -x: per
second reads and writes, MiB/s, mean latency (r_await, w_await: from the
request's arrival to its answer) and the 50th and 99th percentile of its
time in librbd, flushes and discards per second, requests in librbd,
connections served of those the device has, and errors. Each report
covers the interval before it. The figures come from the node daemon.`,
		RunE: func(cmd *cobra.Command, args []string) error {
			if format != "plain" && format != "json" {
				return fmt.Errorf("bad --format %q: want plain or json", format)
			}
			interval, err := parseInterval(intervalArg)
			if err != nil {
				return err
			}
			ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
			defer stop()
			c := g.client(0, 0)
			read := func() ([]control.DeviceStats, time.Time, error) {
				cctx, cancel := context.WithTimeout(ctx, callTimeout)
				defer cancel()
				st, err := c.Stats(cctx)
				return pick(st, args), time.Now(), err
			}
			prev, t0, err := read()
			if err != nil {
				return err
			}
			if err := allMapped(prev, args); err != nil {
				return err
			}
			enc := json.NewEncoder(os.Stdout)
			for n := 0; count == 0 || n < count; n++ {
				select {
				case <-ctx.Done():
					return nil
				case <-time.After(interval):
				}
				cur, t1, err := read()
				if err != nil {
					return err
				}
				rows := iostat.Rows(prev, cur, t1.Sub(t0))
				if format == "json" {
					err = enc.Encode(struct {
						Time    time.Time    `json:"time"`
						Devices []iostat.Row `json:"devices"`
					}{t1, rows})
				} else {
					err = iostat.Write(os.Stdout, t1, rows)
				}
				if err != nil {
					return err
				}
				prev, t0 = cur, t1
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVarP(&intervalArg, "interval", "i", "1", "seconds between reports (2, 0.5, or a duration: 500ms)")
	f.IntVar(&count, "count", 0, "stop after this many reports (0: until interrupted)")
	f.StringVar(&format, "format", "plain", "plain or json (one object per report)")
	return cmd
}

// matches reports whether a device answers to a command-line name: its
// path (/dev/nbd0), its name (nbd0) or its spec.
func matches(r control.Record, name string) bool {
	return name == r.Device() || name == strings.TrimPrefix(r.Device(), "/dev/") || name == r.Spec
}

// pick keeps the devices named (all when none are).
func pick(st []control.DeviceStats, names []string) []control.DeviceStats {
	if len(names) == 0 {
		return st
	}
	var out []control.DeviceStats
	for _, d := range st {
		for _, n := range names {
			if matches(d.Record, n) {
				out = append(out, d)
				break
			}
		}
	}
	return out
}

// allMapped fails on the first name no mapped device answers to.
func allMapped(st []control.DeviceStats, names []string) error {
	for _, n := range names {
		found := false
		for _, d := range st {
			found = found || (matches(d.Record, n) && !d.Record.Detached)
		}
		if !found {
			return fmt.Errorf("%s is not mapped", n)
		}
	}
	return nil
}

// parseInterval reads seconds (2, 0.5) or a Go duration (500ms).
func parseInterval(s string) (time.Duration, error) {
	d, err := time.ParseDuration(s)
	if err != nil {
		f, ferr := strconv.ParseFloat(s, 64)
		if ferr != nil {
			return 0, fmt.Errorf("bad --interval %q: want seconds, like 2 or 0.5", s)
		}
		d = time.Duration(f * float64(time.Second))
	}
	if d < 100*time.Millisecond || d > 24*time.Hour {
		return 0, fmt.Errorf("bad --interval %q: want 0.1 to 86400 seconds", s)
	}
	return d, nil
}
