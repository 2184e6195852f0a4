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
		ctx, cancel := context.WithTimeout(r.Context(), lv.ProbeTimeout)
		defer cancel()
		resp, err := client.Probe(ctx, &csi.ProbeRequest{})
		switch {
		case err != nil:
			lv.log().Warn("liveness: probe failed", "err", err)
			http.Error(w, "probe: "+err.Error(), http.StatusInternalServerError)
		case resp.GetReady() != nil && !resp.GetReady().GetValue():
			lv.log().Warn("liveness: plugin not ready")
			http.Error(w, "plugin not ready", http.StatusInternalServerError)
		default:
			fmt.Fprintln(w, "ok")
		}
	})
	return mux
}

// Serve answers on l until ctx ends. The CSI connection is lazy: a
// plugin that starts after us, or restarts, is found again by gRPC.
func (lv *Liveness) Serve(ctx context.Context, l net.Listener) error {
	addr := lv.CSIAddress
	if len(addr) > 0 && addr[0] == '/' {
		addr = "unix://" + addr
	}
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return fmt.Errorf("liveness: CSI address %q: %w", lv.CSIAddress, err)
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
