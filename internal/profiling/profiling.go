// Package profiling serves Go's pprof endpoints over HTTP for
// --enableprofiling (ceph-csi's flag): on loopback unless a host is
// given, since profiles show memory contents and cost CPU to take.
package profiling

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/internal/loopback"
)

// Listen opens addr: "PORT" or ":PORT" mean 127.0.0.1.
func Listen(addr string) (net.Listener, error) { return loopback.Listen("profiling", addr) }

// Serve answers /debug/pprof/ on l until ctx ends.
func Serve(ctx context.Context, l net.Listener, log *slog.Logger) error {
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	stop := context.AfterFunc(ctx, func() { srv.Close() })
	defer stop()
	log.Info("serving pprof", "address", l.Addr().String())
	if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
