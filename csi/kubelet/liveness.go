package kubelet

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// Liveness serves the kubelet's liveness probe for a CSI plugin: each
// GET of /healthz calls the plugin's Probe, as the livenessprobe sidecar
// does, so a wedged plugin is restarted and a healthy one is left alone.
type Liveness struct {
	// CSIAddress is the plugin's socket path (or unix:// address).
	CSIAddress string
	// ProbeTimeout bounds each Probe call.
	ProbeTimeout time.Duration
	Log          *slog.Logger
}

// Handler answers /healthz: 200 when Probe says ready (or says nothing,
// which CSI defines as ready), 500 with the reason otherwise.
func (lv *Liveness) Handler(conn *grpc.ClientConn) http.Handler {
	mux := http.NewServeMux()
	client := csi.NewIdentityClient(conn)
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) {
		if err := lv.check(r.Context(), client); err != nil {
			lv.log().Warn("liveness: " + err.Error())
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	return mux
}

// check calls Probe once: nil when the plugin is ready (or says
// nothing, which CSI defines as ready).
func (lv *Liveness) check(ctx context.Context, client csi.IdentityClient) error {
	ctx, cancel := context.WithTimeout(ctx, lv.ProbeTimeout)
	defer cancel()
	resp, err := client.Probe(ctx, &csi.ProbeRequest{})
	switch {
	case err != nil:
		return fmt.Errorf("probe failed: %w", err)
	case resp.GetReady() != nil && !resp.GetReady().GetValue():
		return errors.New("plugin not ready")
	}
	return nil
}

// Once probes the plugin once, for a kubelet exec probe: no port, so a
// DaemonSet's old and new pods on the host's network, overlapping in an
// upgrade, each probe their own plugin.
func (lv *Liveness) Once(ctx context.Context) error {
	conn, err := lv.dial()
	if err != nil {
		return err
	}
	defer conn.Close()
	return lv.check(ctx, csi.NewIdentityClient(conn))
}

func (lv *Liveness) dial() (*grpc.ClientConn, error) {
	addr := lv.CSIAddress
	if len(addr) > 0 && addr[0] == '/' {
		addr = "unix://" + addr
	}
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("liveness: CSI address %q: %w", lv.CSIAddress, err)
	}
	return conn, nil
}

// Serve answers on l until ctx ends. The CSI connection is lazy: a
// plugin that starts after us, or restarts, is found again by gRPC.
func (lv *Liveness) Serve(ctx context.Context, l net.Listener) error {
	conn, err := lv.dial()
	if err != nil {
		return err
	}
	defer conn.Close()
	srv := &http.Server{Handler: lv.Handler(conn), ReadHeaderTimeout: 10 * time.Second}
	stop := context.AfterFunc(ctx, func() { srv.Close() })
	defer stop()
	lv.log().Info("serving liveness", "addr", l.Addr().String(), "csi", lv.CSIAddress)
	if err := srv.Serve(l); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

func (lv *Liveness) log() *slog.Logger {
	if lv.Log == nil {
		return slog.New(slog.DiscardHandler)
	}
	return lv.Log
}
