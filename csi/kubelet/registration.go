package kubelet

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"

	"google.golang.org/grpc"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"github.com/rbd-nbd-go/rbd-nbd-go/internal/unixsock"
)

// DefaultRegistrationDir is where the kubelet's plugin watcher looks for
// registration sockets.
const DefaultRegistrationDir = "/var/lib/kubelet/plugins_registry"

// Registration answers the kubelet's plugin watcher for one CSI driver.
type Registration struct {
	// Driver is the CSI driver name the kubelet will know the plugin by.
	Driver string
	// Endpoint is the CSI socket's path as the kubelet sees it (on the
	// host, not in the plugin's container).
	Endpoint string
	Log      *slog.Logger

	registerapi.UnimplementedRegistrationServer
}

// SocketPath is the registration socket in dir: <driver>-reg.sock, the
// name node-driver-registrar uses, so the two can replace each other.
func (r *Registration) SocketPath(dir string) string {
	return filepath.Join(dir, r.Driver+"-reg.sock")
}

// Serve registers the plugin: it answers on dir's registration socket
// until ctx ends, then removes the socket so that the kubelet forgets a
// plugin that was shut down on purpose. A plugin killed outright leaves
// the socket behind; its successor replaces it.
func (r *Registration) Serve(ctx context.Context, dir string) error {
	if r.Driver == "" || !filepath.IsAbs(r.Endpoint) {
		return fmt.Errorf("registration needs a driver name and the CSI socket's absolute host path (got %q, %q)", r.Driver, r.Endpoint)
	}
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return err
	}
	path := r.SocketPath(dir)
	// Replace: in an upgrade the old plugin pod still runs; the kubelet
	// must find this one.
	l, err := unixsock.Replace(path)
	if err != nil {
		return fmt.Errorf("registration socket: %w", err)
	}
	s := grpc.NewServer()
	registerapi.RegisterRegistrationServer(s, r)
	// Stopping closes the listener, which removes the socket unless a
	// newer plugin has replaced it.
	stop := context.AfterFunc(ctx, s.GracefulStop)
	defer stop()
	r.log().Info("serving kubelet plugin registration", "socket", path, "endpoint", r.Endpoint)
	err = s.Serve(l)
	if ctx.Err() != nil || errors.Is(err, grpc.ErrServerStopped) {
		return nil
	}
	return err
}

// GetInfo tells the kubelet which driver this is and where its CSI
// socket is.
func (r *Registration) GetInfo(context.Context, *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	return &registerapi.PluginInfo{
		Type:              registerapi.CSIPlugin,
		Name:              r.Driver,
		Endpoint:          r.Endpoint,
		SupportedVersions: []string{"1.0.0"},
	}, nil
}

// NotifyRegistrationStatus logs the kubelet's verdict. A refusal is an
// error an operator must see: the kubelet will not call this node
// plugin, and it tries again only when the socket is recreated.
func (r *Registration) NotifyRegistrationStatus(_ context.Context, st *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	if st.PluginRegistered {
		r.log().Info("registered with the kubelet", "driver", r.Driver)
	} else {
		r.log().Error("the kubelet refused the registration", "driver", r.Driver, "err", st.Error)
	}
	return &registerapi.RegistrationStatusResponse{}, nil
}

func (r *Registration) log() *slog.Logger {
	if r.Log == nil {
		return slog.New(slog.DiscardHandler)
	}
	return r.Log
}
