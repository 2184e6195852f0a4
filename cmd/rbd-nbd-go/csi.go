package main

import (
	"context"
	"fmt"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sync/errgroup"
	"k8s.io/klog/v2"
	"k8s.io/mount-utils"
	utilexec "k8s.io/utils/exec"

	"github.com/rbd-nbd-go/rbd-nbd-go/csi"
	"github.com/rbd-nbd-go/rbd-nbd-go/csi/kubelet"
	"github.com/rbd-nbd-go/rbd-nbd-go/rbdio"
)

type csiOpts struct {
	endpoint, nodeID, driverName string
	controller, node             bool
	clustersConfig               string
	nodeRegistry                 string
	controllerSecretDir          string
	registrationPath             string
	registrationDir              string
}

// newCSI is the CSI driver's entry point, with ceph-csi's flag names:
// one image serves the controller and the node roles.
func newCSI(g *globalOpts, version string) *cobra.Command {
	var o csiOpts
	cmd := &cobra.Command{
		Use:   "csi --endpoint unix:///csi/csi.sock [--controllerserver] [--nodeserver --nodeid NODE]",
		Short: "Serve the CSI driver (controller and/or node service)",
		Long: `Serve the CSI driver: the controller service (image management through
librbd) and/or the node service (stage/publish through this node's
rbd-nbd-go daemon, which it starts at once so that a restarted plugin's
devices are reattached before I/O times out). The clusters config,
StorageClass parameters and Secret keys are ceph-csi's.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return runCSI(g, o, version)
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.endpoint, "endpoint", "unix:///csi/csi.sock", "CSI endpoint (unix:///path or tcp://host:port)")
	f.StringVar(&o.nodeID, "nodeid", "", "this node's ID (the node service needs it)")
	f.StringVar(&o.driverName, "drivername", csi.DefaultDriverName, "CSI driver name")
	f.BoolVar(&o.controller, "controllerserver", false, "serve the controller service")
	f.BoolVar(&o.node, "nodeserver", false, "serve the node service")
	f.StringVar(&o.clustersConfig, "clusters-config", "/etc/ceph-csi-config/config.json",
		"ceph-csi's clusters config.json: clusterID, monitors, rbd.radosNamespace")
	f.StringVar(&o.controllerSecretDir, "controller-secret-dir", "",
		"directory with userID and userKey files (a mounted Secret): credentials for the calls that carry none (ListVolumes, GetCapacity, Probe)")
	f.StringVar(&o.nodeRegistry, "node-registry", "",
		"directory shared by controller and nodes: nodes register there and ControllerPublish refuses unknown node IDs (default: accept any)")
	f.StringVar(&o.registrationPath, "kubelet-registration-path", "",
		"register the node plugin with the kubelet, giving it this host path of the CSI socket (leave empty when node-driver-registrar does it)")
	f.StringVar(&o.registrationDir, "plugin-registration-dir", kubelet.DefaultRegistrationDir,
		"the kubelet's plugin registration directory, as mounted in this container")
	return cmd
}

func runCSI(g *globalOpts, o csiOpts, version string) error {
	if !o.controller && !o.node {
		return fmt.Errorf("give --controllerserver, --nodeserver or both")
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	log := logger(g.logLevel)
	klog.SetSlogLogger(log) // mount-utils logs through klog
	cfg := csi.Config{Name: o.driverName, Version: version, NodeID: o.nodeID, Controller: o.controller,
		Node: o.node, ClustersConfig: o.clustersConfig, StateDir: g.stateDir, Log: log,
		ControllerSecretDir: o.controllerSecretDir}
	if o.nodeRegistry != "" {
		reg := csi.DirRegistry{Dir: o.nodeRegistry}
		if o.controller {
			cfg.Nodes = reg
		}
		if o.node {
			if err := reg.Register(o.nodeID); err != nil {
				return fmt.Errorf("node registry: %w", err)
			}
		}
	}
	if o.controller {
		cfg.Images = rbdio.NewClusters()
	}
	if o.node {
		c := g.client(0, 0)
		// Start the daemon now, not on the first request: after a
		// restart it must take every device back before the kernel's
		// dead-connection timeout fails their I/O.
		// If it cannot start (no NBD in this kernel), the plugin still
		// serves: Probe says not ready, and the next map tries again.
		sctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
		if err := c.EnsureRunning(sctx); err != nil {
			log.Error("the node daemon is not running", "err", err)
		}
		cancel()
		cfg.Attacher = c
		cfg.Mounter = mount.NewSafeFormatAndMount(mount.New(""), utilexec.New())
	}
	d, err := csi.New(cfg)
	if err != nil {
		return err
	}
	l, err := csi.Listen(o.endpoint)
	if err != nil {
		return err
	}
	// The registration socket opens beside the CSI socket, which already
	// listens: the kubelet calls NodeGetInfo as soon as it learns of us.
	// Either failing stops the other, and the plugin exits with the error.
	eg, ectx := errgroup.WithContext(ctx)
	eg.Go(func() error { return d.Serve(ectx, l) })
	if o.node && o.registrationPath != "" {
		reg := &kubelet.Registration{Driver: o.driverName, Endpoint: o.registrationPath, Log: log}
		eg.Go(func() error { return reg.Serve(ectx, o.registrationDir) })
	}
	return eg.Wait()
}
