package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"runtime/pprof"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/rbd-nbd-go/rbd-nbd-go/backend"
	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
	"github.com/rbd-nbd-go/rbd-nbd-go/internal/sysmon"
	"github.com/rbd-nbd-go/rbd-nbd-go/internal/unixsock"
	"github.com/rbd-nbd-go/rbd-nbd-go/metrics"
	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
	"github.com/rbd-nbd-go/rbd-nbd-go/rbdio"
)

type serveOpts struct {
	socket, listen, name string
	readOnly, exclusive  bool
	zeroCopy             bool
	ceph                 ceph.Options
	shutdownTimeout      time.Duration
	cpuProfile           string
	metricsAddress       string
}

func newServe(g *globalOpts) *cobra.Command {
	var o serveOpts
	cmd := &cobra.Command{
		Use:   "serve [--socket PATH | --listen HOST:PORT] [--read-only] [--exclusive] [--name EXPORT] [Ceph options] SPEC",
		Short: "Export an RBD image (or mem:SIZE, file:PATH) over NBD",
		Long: `Export a device over NBD to userspace clients (nbdinfo, qemu, fio, nbd-client).

SPEC is an RBD image, [rbd:][pool/[namespace/]]image[@snap] (pool defaults
to rbd; a snapshot is read-only), mem:SIZE (a sparse in-memory disk, e.g.
mem:1G) or file:PATH (a regular file or block device). RBD images are
served through librbd's aio API with the cache off, so acknowledged writes
never live only in this process. A unix socket is created mode 0600; TCP
listens on 127.0.0.1 unless a host is given. Without --socket or --listen
the server expects a socket-activation listener (LISTEN_FDS), as started
by nbdinfo/nbdcopy "-- [ command ]". SIGINT/SIGTERM finish requests in
flight, flush, and exit.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			o.ceph = g.ceph
			return runServe(cmd.Context(), logger(g.logLevel), o, args[0])
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.socket, "socket", "", "listen on this unix socket path")
	f.StringVar(&o.listen, "listen", "", "listen on TCP HOST:PORT (PORT alone means 127.0.0.1)")
	f.StringVar(&o.name, "name", "", "export name (empty is the default export)")
	f.BoolVar(&o.readOnly, "read-only", false, "refuse writes")
	f.BoolVar(&o.exclusive, "exclusive", false, "take the RBD exclusive lock and keep it")
	f.BoolVar(&o.zeroCopy, "zero-copy", false,
		"splice large read replies into unix sockets instead of copying them; only for clients that read with read/recv (libnbd, qemu, nbd-client), not ones that splice what they receive")
	f.DurationVar(&o.shutdownTimeout, "shutdown-timeout", 30*time.Second,
		"how long to wait for requests in flight on shutdown")
	f.StringVar(&o.metricsAddress, "metrics-address", "",
		"serve Prometheus metrics of the export on HOST:PORT or PORT (loopback unless a host is given)")
	f.StringVar(&o.cpuProfile, "cpu-profile", "", "write a Go CPU profile here until exit (development)")
	f.MarkHidden("cpu-profile")
	cmd.MarkFlagsMutuallyExclusive("socket", "listen")
	return cmd
}

func logger(s string) *slog.Logger {
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(s)); err != nil {
		lvl = slog.LevelInfo
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: lvl}))
}

func listen(o serveOpts) (net.Listener, string, error) {
	switch {
	case o.socket != "":
		l, err := unixsock.Listen(o.socket)
		return l, "unix:" + o.socket, err
	case o.listen != "":
		l, err := nbd.ListenTCP(o.listen)
		if err != nil {
			return nil, "", err
		}
		return l, "tcp:" + l.Addr().String(), nil
	}
	l, err := nbd.ActivationListener()
	if err == nil && l == nil {
		err = errors.New("one of --socket or --listen is required")
	}
	return l, "socket-activation", err
}

func runServe(ctx context.Context, log *slog.Logger, o serveOpts, spec string) error {
	var ml net.Listener
	if o.metricsAddress != "" {
		var err error
		if ml, err = metrics.Listen(o.metricsAddress); err != nil {
			return err
		}
		defer ml.Close()
	}
	dev, err := backend.Open(spec, backend.Options{ReadOnly: o.readOnly, Exclusive: o.exclusive,
		Ceph: o.ceph, Clusters: rbdio.NewClusters(),
		OnResize: func(size uint64) { log.Info("image resized; new connections see the new size", "size", size) }})
	if err != nil {
		return err
	}
	defer dev.Close()
	zc := nbd.ZeroCopyOff
	if o.zeroCopy {
		zc = nbd.ZeroCopyUnix
	}
	srv := nbd.NewServer(nbd.Config{Logger: log, ZeroCopy: zc})
	var stats *nbd.Stats
	if ml != nil {
		stats = nbd.NewStats()
	}
	if err := srv.AddExport(nbd.Export{Name: o.name, Description: dev.Describe,
		Backend: dev.Backend, ReadOnly: o.readOnly, Stats: stats}); err != nil {
		return err
	}
	l, where, err := listen(o)
	if err != nil {
		return err
	}
	// Only once there is something to serve: misuse stays one line.
	sysmon.Setup(log)
	if ctx == nil {
		ctx = context.Background()
	}
	if o.cpuProfile != "" {
		f, err := os.Create(o.cpuProfile)
		if err != nil {
			return err
		}
		pprof.StartCPUProfile(f)
		defer pprof.StopCPUProfile()
	}
	ctx, stop := signal.NotifyContext(ctx, syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(l) }()
	if ml != nil {
		reg := metrics.NewRegistry(func() []metrics.Device {
			return []metrics.Device{metrics.ForSpec(where, spec, "", stats.Snapshot())}
		}, nil)
		go metrics.Serve(ctx, ml, reg, log)
	}
	log.Info("serving", "spec", spec, "export", o.name, "on", where,
		"size", dev.Backend.Size(), "read_only", o.readOnly)
	select {
	case err = <-errc:
		return fmt.Errorf("serve: %w", err)
	case <-ctx.Done():
	}
	stop() // a second signal kills us the default way
	log.Info("shutting down")
	sctx, cancel := context.WithTimeout(context.Background(), o.shutdownTimeout)
	defer cancel()
	serr := srv.Shutdown(sctx)
	if err := nbd.Flush(dev.Backend); err != nil {
		return fmt.Errorf("final flush: %w", err)
	}
	if serr != nil {
		return fmt.Errorf("shutdown: %w", serr)
	}
	return nil
}
