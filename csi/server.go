package csi

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"runtime/debug"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/kubernetes-csi/csi-lib-utils/protosanitizer"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/rbd-nbd-go/rbd-nbd-go/internal/unixsock"
)

// Listen opens a CSI endpoint: unix:///path (unixsock.Listen: mode 0600,
// a stale socket replaced) or tcp://host:port. With replaceLive, a unix
// socket a live plugin serves is taken over too (unixsock.Replace): the
// node plugin's old and new pods overlap in an upgrade.
func Listen(endpoint string, replaceLive bool) (net.Listener, error) {
	u, err := url.Parse(endpoint)
	if err != nil {
		return nil, fmt.Errorf("endpoint %q: %w", endpoint, err)
	}
	switch u.Scheme {
	case "unix":
		path := u.Path
		if u.Host != "" {
			path = u.Host + u.Path // unix://relative/path
		}
		if path == "" {
			return nil, fmt.Errorf("endpoint %q: no socket path", endpoint)
		}
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			return nil, err
		}
		// 0600 from the first moment; a dead plugin's socket replaced,
		// a live one's refused unless asked.
		if replaceLive {
			return unixsock.Replace(path)
		}
		return unixsock.Listen(path)
	case "tcp":
		return net.Listen("tcp", u.Host)
	}
	return nil, fmt.Errorf("endpoint %q: want unix:///path or tcp://host:port", endpoint)
}

// Server returns a gRPC server with the driver's services registered
// and its interceptors installed.
func (d *Driver) Server() *grpc.Server {
	s := grpc.NewServer(grpc.ChainUnaryInterceptor(d.logCalls, d.recoverPanics, d.waitDaemon))
	csi.RegisterIdentityServer(s, d)
	if d.cfg.Controller {
		csi.RegisterControllerServer(s, d)
	}
	if d.cfg.Node {
		csi.RegisterNodeServer(s, d)
	}
	return s
}

// Serve answers on l until ctx ends, then stops gracefully.
func (d *Driver) Serve(ctx context.Context, l net.Listener) error {
	s := d.Server()
	stop := context.AfterFunc(ctx, s.GracefulStop)
	defer stop()
	d.log.Info("serving CSI", "driver", d.cfg.Name, "controller", d.cfg.Controller, "node", d.cfg.Node,
		"nodeid", d.cfg.NodeID, "endpoint", l.Addr().String())
	if d.cfg.Controller {
		sctx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { defer close(done); d.sweep(sctx) }()
		defer func() {
			cancel()
			<-done
			// Running flattens stop where they are; they stay owed in
			// the journal, and the next controller resumes them.
			d.flat.stopAll(10 * time.Second)
		}()
	}
	err := s.Serve(l)
	if ctx.Err() != nil {
		return nil
	}
	return err
}

// logCalls gives each call an ID, logs it with its secrets stripped
// (protosanitizer), and its outcome and duration; calls slower than
// SlowCall are logged at warning level.
func (d *Driver) logCalls(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	id := d.requestSeq.Add(1)
	log := d.log.With("req", id, "method", info.FullMethod)
	probe := info.FullMethod == "/csi.v1.Identity/Probe"
	if !probe {
		log.Debug("call", "request", protosanitizer.StripSecrets(req).String())
	}
	t0 := time.Now()
	resp, err := h(ctx, req)
	took := time.Since(t0)
	if d.cfg.Calls != nil {
		d.cfg.Calls.ObserveCall(info.FullMethod, status.Code(err).String(), took)
	}
	lvl := slog.LevelDebug
	if err != nil {
		lvl = slog.LevelInfo
		if c := status.Code(err); c == codes.Internal || c == codes.Unknown {
			lvl = slog.LevelError
		}
	}
	if took > d.cfg.SlowCall {
		lvl = max(lvl, slog.LevelWarn)
	}
	if !probe || err != nil {
		attrs := []any{"took", took.Round(time.Millisecond), "code", status.Code(err).String()}
		if err != nil {
			attrs = append(attrs, "err", status.Convert(err).Message(), "request", protosanitizer.StripSecrets(req).String())
		}
		if took > d.cfg.SlowCall {
			attrs = append(attrs, "slow", true)
		}
		log.Log(ctx, lvl, "done", attrs...)
	}
	return resp, err
}

// recoverPanics turns a panic in a handler into Internal, with the stack
// logged, instead of taking the plugin (and the node's volumes' control
// path) down.
func (d *Driver) recoverPanics(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (resp any, err error) {
	defer func() {
		if p := recover(); p != nil {
			d.log.Error("panic in CSI call", "method", info.FullMethod, "panic", p, "stack", string(debug.Stack()))
			err = status.Errorf(codes.Internal, "internal error in %s: %v", info.FullMethod, p)
		}
	}()
	return h(ctx, req)
}

// daemonReady reports whether the plugin's start-up hold on the node
// daemon has ended (Config.DaemonReady).
func (d *Driver) daemonReady() bool {
	if d.cfg.DaemonReady == nil {
		return true
	}
	select {
	case <-d.cfg.DaemonReady:
		return true
	default:
		return false
	}
}

// waitDaemon holds the node's volume calls until the plugin's start-up
// take-over of the node daemon has ended: until then a call that found
// no daemon would start one of its own, racing the one taking the
// devices back. NodeGetInfo and NodeGetCapabilities need no daemon.
func (d *Driver) waitDaemon(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	if d.daemonReady() || !strings.HasPrefix(info.FullMethod, "/csi.v1.Node/") ||
		info.FullMethod == "/csi.v1.Node/NodeGetInfo" || info.FullMethod == "/csi.v1.Node/NodeGetCapabilities" {
		return h(ctx, req)
	}
	select {
	case <-d.cfg.DaemonReady:
		return h(ctx, req)
	case <-ctx.Done():
		return nil, status.Error(codes.Unavailable, "the node daemon is still taking this node's devices back; try again")
	}
}
