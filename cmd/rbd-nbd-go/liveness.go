package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/rbd-nbd-go/rbd-nbd-go/csi/kubelet"
)

// newLiveness is the livenessprobe sidecar's job with its flag names, so
// a pod spec can use either image.
func newLiveness(g *globalOpts) *cobra.Command {
	var (
		addr, endpoint string
		port           int
		timeout        time.Duration
		once           bool
	)
	cmd := &cobra.Command{
		Use:   "liveness --csi-address /csi/csi.sock [--http-endpoint 127.0.0.1:9808]",
		Short: "Serve /healthz for the kubelet by calling the CSI plugin's Probe",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			lv := &kubelet.Liveness{CSIAddress: addr, ProbeTimeout: timeout, Log: logger(g.logLevel)}
			if once {
				if err := lv.Once(context.Background()); err != nil {
					fmt.Fprintln(os.Stderr, err)
					return &exitError{code: 1}
				}
				return nil
			}
			if endpoint == "" {
				endpoint = fmt.Sprintf("127.0.0.1:%d", port)
			}
			// SO_REUSEPORT: in an upgrade the old and new node pods
			// overlap on the host's network, and the new pod's sidecar
			// must start. Either answers for whatever plugin the shared
			// CSI socket leads to, so the new pod may count as started
			// before its daemon took over: the old plugin therefore
			// waits for the handover when stopped (csi --takeover-wait).
			lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
				var serr error
				err := c.Control(func(fd uintptr) {
					serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEPORT, 1)
				})
				return errors.Join(err, serr)
			}}
			l, err := lc.Listen(context.Background(), "tcp", endpoint)
			if err != nil {
				return err
			}
			ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
			defer stop()
			return lv.Serve(ctx, l)
		},
	}
	f := cmd.Flags()
	f.StringVar(&addr, "csi-address", "/run/csi/socket", "the CSI plugin's socket")
	f.IntVar(&port, "health-port", 9808, "port on 127.0.0.1 for /healthz (unless --http-endpoint)")
	f.StringVar(&endpoint, "http-endpoint", "", "host:port for /healthz (default 127.0.0.1:<health-port>; loopback unless told otherwise)")
	f.DurationVar(&timeout, "probe-timeout", time.Second, "how long one Probe may take")
	f.BoolVar(&once, "once", false, "probe once and exit 0 if ready, 1 if not (a kubelet exec probe)")
	return cmd
}
