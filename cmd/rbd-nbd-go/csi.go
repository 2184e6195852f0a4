package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/cobra"
	"golang.org/x/sync/errgroup"
	"k8s.io/klog/v2"
	"k8s.io/mount-utils"
	utilexec "k8s.io/utils/exec"

	"github.com/rbd-nbd-go/rbd-nbd-go/csi"
	"github.com/rbd-nbd-go/rbd-nbd-go/csi/k8snodes"
	"github.com/rbd-nbd-go/rbd-nbd-go/csi/kubelet"
	"github.com/rbd-nbd-go/rbd-nbd-go/daemon"
	"github.com/rbd-nbd-go/rbd-nbd-go/internal/pidlimit"
	"github.com/rbd-nbd-go/rbd-nbd-go/internal/profiling"
	"github.com/rbd-nbd-go/rbd-nbd-go/kernel"
	"github.com/rbd-nbd-go/rbd-nbd-go/metrics"
	"github.com/rbd-nbd-go/rbd-nbd-go/rbdio"
)

type csiOpts struct {
	endpoint, nodeID, driverName string
	controller, node             bool
	clustersConfig               string
	kmsConfig                    string
	nodeRegistry                 string
	controllerSecretDir          string
	registrationPath             string
	registrationDir              string
	takeoverWait                 time.Duration
	metricsAddress               string

	// ceph-csi's own flags, so its Deployment's arguments work unchanged.
	driverType       string
	verbosity        int
	pidLimit         int
	profiling        bool
	profilingAddress string
	limits           csi.Limits
	sweepInterval    time.Duration
	flattenProgress  time.Duration
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
	f.StringVar(&o.kmsConfig, "kms-config", csi.DefaultKMSConfig,
		"ceph-csi's KMS config (the csi-kms-connection-details ConfigMap as a file): what encryptionKMSID names")
	f.StringVar(&o.controllerSecretDir, "controller-secret-dir", "",
		"directory with userID and userKey files (a mounted Secret): credentials for the calls that carry none (ListVolumes, GetCapacity, ControllerPublish)")
	f.StringVar(&o.nodeRegistry, "node-registry", "",
		"directory shared by controller and nodes: nodes register there, and ControllerPublish knows them besides the CSINodes (in Kubernetes) and its own node")
	f.StringVar(&o.registrationPath, "kubelet-registration-path", "",
		"register the node plugin with the kubelet, giving it this host path of the CSI socket (leave empty when node-driver-registrar does it)")
	f.DurationVar(&o.takeoverWait, "takeover-wait", 45*time.Second,
		"when stopped, keep the node daemon serving up to this long for a newer plugin's daemon to take its devices over (an upgrade)")
	f.StringVar(&o.metricsAddress, "metrics-address", "",
		"serve the plugin's Prometheus metrics (CSI calls by method and code, with durations) on HOST:PORT or PORT (loopback unless a host is given)")
	f.StringVar(&o.registrationDir, "plugin-registration-dir", kubelet.DefaultRegistrationDir,
		"the kubelet's plugin registration directory, as mounted in this container")
	// ceph-csi's flags, with its names and defaults.
	f.StringVar(&o.driverType, "type", "rbd", "driver type, as ceph-csi's: only rbd is served")
	f.IntVar(&o.verbosity, "v", 0, "log verbosity on klog's scale: 0-3 info, 4 and up debug (overrides --log-level)")
	f.IntVar(&o.pidLimit, "pidlimit", 0, "PID limit of the plugin's own cgroup: -1 unlimited, 0 leave it")
	f.BoolVar(&o.profiling, "enableprofiling", false, "serve Go's pprof at --profiling-address")
	f.StringVar(&o.profilingAddress, "profiling-address", "6060", "HOST:PORT for pprof (a bare PORT means 127.0.0.1)")
	def := csi.DefaultLimits()
	f.IntVar(&o.limits.HardDepth, "rbdhardmaxclonedepth", def.HardDepth,
		"hard limit on a volume's clone depth: CreateVolume answers Aborted while the source is flattened")
	f.IntVar(&o.limits.SoftDepth, "rbdsoftmaxclonedepth", def.SoftDepth,
		"soft limit on clone depth: deeper new volumes are flattened in the background")
	f.IntVar(&o.limits.MaxSnapshots, "maxsnapshotsonimage", def.MaxSnapshots,
		"snapshots one image may have (trashed ones kept for clones included); past it CreateSnapshot waits for flattens or refuses")
	f.IntVar(&o.limits.MinSnapshots, "minsnapshotsonimage", def.MinSnapshots,
		"snapshots past which the clones of an image's trashed snapshots are flattened in the background")
	f.DurationVar(&o.sweepInterval, "sweep-interval", time.Minute,
		"how often the controller resumes owed flattens and removes deleted volumes' images nothing needs")
	f.DurationVar(&o.flattenProgress, "flatten-progress-interval", 10*time.Second, "how often a running flatten logs its progress")
	return cmd
}

// imagesLinger is how long the plugin keeps a cluster connection after
// its last call: a provisioning burst, or the controller's sweeps, then
// connect once instead of once a call. imagesMaxAge bounds how long one
// session is reused: a blocklist of it heals within that.
const (
	imagesLinger = 5 * time.Minute
	imagesMaxAge = 15 * time.Minute
)

func runCSI(g *globalOpts, o csiOpts, version string) error {
	if o.driverType != "rbd" {
		return fmt.Errorf("--type %q: this driver serves rbd only", o.driverType)
	}
	if !o.controller && !o.node {
		return fmt.Errorf("give --controllerserver, --nodeserver or both")
	}
	if err := o.limits.Validate(); err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	level := g.logLevel
	if o.verbosity >= 4 {
		level = "debug"
	} else if o.verbosity > 0 {
		level = "info"
	}
	log := logger(level)
	if age, ok := daemon.ProcessAge(os.Getpid()); ok {
		// Where a restart's wait goes: before main (container set-up,
		// exec) or after it (the daemon logs its own start).
		log.Info("plugin starting", "plugin_started_ago", age.Round(time.Millisecond))
	}
	klog.SetSlogLogger(log) // mount-utils logs through klog
	if path, err := (pidlimit.Cgroup{}).Set(o.pidLimit); err != nil {
		return err
	} else if path != "" {
		log.Info("set the pid limit", "limit", o.pidLimit, "file", path)
	}
	var reg *prometheus.Registry
	if o.metricsAddress != "" {
		if _, err := metrics.Address(o.metricsAddress); err != nil {
			return err
		}
		reg = prometheus.NewRegistry()
	}
	cfg := csi.Config{Name: o.driverName, Version: version, NodeID: o.nodeID, Controller: o.controller,
		Node: o.node, ClustersConfig: o.clustersConfig, KMSConfig: o.kmsConfig, StateDir: g.stateDir, Log: log, Limits: o.limits,
		SweepInterval: o.sweepInterval, FlattenProgress: o.flattenProgress,
		ControllerSecretDir: o.controllerSecretDir, NBDResends: kernel.ResendsOnNewSocket(kernel.Release())}
	if o.nodeRegistry != "" && o.node {
		if err := (csi.DirRegistry{Dir: o.nodeRegistry}).Register(o.nodeID); err != nil {
			return fmt.Errorf("node registry: %w", err)
		}
	}
	if o.controller {
		nodes, err := nodeRegistry(o, log)
		if err != nil {
			return err
		}
		cfg.Nodes = nodes
	}
	// The node reads an encrypted volume's sealed key from its image's
	// metadata; it opens a cluster connection only for those.
	cfg.Images = rbdio.NewClustersLinger(imagesLinger, imagesMaxAge)
	if o.node {
		c := g.client(0, 0)
		// Start the daemon now, not on the first request: after a
		// restart it must take every device back before the kernel's
		// dead-connection timeout fails their I/O.
		// If it cannot start (no NBD in this kernel), the plugin still
		// serves: Probe says not ready, and the next map tries again.
		// A daemon already running belongs to the plugin pod this one
		// replaces (an upgrade with the pods overlapping): take its
		// devices over, so they never see a dead connection.
		// The CSI socket opens meanwhile (csi.Config.DaemonReady).
		pd := c.NewPluginDaemon()
		ready := make(chan struct{})
		cfg.DaemonReady = ready
		go func() {
			sctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
			err := pd.Start(sctx)
			cancel()
			if err != nil {
				log.Error("the node daemon is not running", "err", err)
			}
			close(ready)
			pd.Supervise(ctx, time.Second, func(err error) {
				if err != nil {
					log.Error("the node daemon is not answering and would not start: trying again later", "err", err)
					return
				}
				log.Warn("the node daemon had stopped answering: started it again")
			})
		}()
		defer func() {
			if ctx.Err() == nil {
				return // not stopped: failed at start
			}
			<-ready // a take-over under way ends first (its context is ctx's)
			t0 := time.Now()
			taken := pd.Release(o.takeoverWait)
			log.Info("stopping: the node daemon stops with this pod", "taken_over_by_a_newer_daemon", taken,
				"waited", time.Since(t0).Round(time.Millisecond))
		}()
		cfg.Daemon = c
		cfg.Mounter = mount.NewSafeFormatAndMount(mount.New(""), utilexec.New())
	}
	if reg != nil {
		cfg.Calls = metrics.NewCSICalls(reg, o.driverName)
	}
	d, err := csi.New(cfg)
	if err != nil {
		return err
	}
	l, err := csi.Listen(o.endpoint, o.node)
	if err != nil {
		return err
	}
	// The CSI socket listens at once (Probe says not ready until the
	// node daemon is taken over); the registration socket opens after
	// that, and the kubelet calls NodeGetInfo as soon as it learns of
	// us. Either failing stops the other, and the plugin exits with the
	// error.
	var pl net.Listener
	if o.profiling {
		if pl, err = profiling.Listen(o.profilingAddress); err != nil {
			l.Close()
			return err
		}
	}
	eg, ectx := errgroup.WithContext(ctx)
	eg.Go(func() error { return d.Serve(ectx, l) })
	if pl != nil {
		eg.Go(func() error { return profiling.Serve(ectx, pl, log) })
	}
	if reg != nil {
		// In an upgrade the old pod holds the port until it stops:
		// retried, and never a reason to stop serving CSI.
		eg.Go(func() error { metrics.ServeRetrying(ectx, o.metricsAddress, reg, log); return nil })
	}
	if o.node && o.registrationPath != "" {
		// The kubelet hears of us once the take-over has ended: its
		// registration and the API traffic that follows (NodeGetInfo,
		// CSINode) would otherwise compete with fencing and reattaching
		// for a small node's CPU, while every volume waits.
		reg := &kubelet.Registration{Driver: o.driverName, Endpoint: o.registrationPath, Log: log}
		eg.Go(func() error {
			select {
			case <-cfg.DaemonReady:
			case <-ectx.Done():
				return nil
			}
			return reg.Serve(ectx, o.registrationDir)
		})
	}
	return eg.Wait()
}

// nodeRegistry is how ControllerPublish tells real nodes from others:
// in Kubernetes, the node's CSINode; the process's own node ID when it
// serves the node role too; the --node-registry directory. Where none
// applies (a controller alone, outside Kubernetes) any node ID passes.
func nodeRegistry(o csiOpts, log *slog.Logger) (csi.NodeRegistry, error) {
	var rs csi.AnyRegistry
	if k, ok, err := k8snodes.InCluster(o.driverName); err != nil {
		return nil, err
	} else if ok {
		rs = append(rs, k)
	}
	if o.node {
		rs = append(rs, csi.SelfRegistry{NodeID: o.nodeID})
	}
	if o.nodeRegistry != "" {
		rs = append(rs, csi.DirRegistry{Dir: o.nodeRegistry})
	}
	if len(rs) == 0 {
		log.Warn("ControllerPublish cannot tell real nodes: not in Kubernetes, no node role, no --node-registry; any node ID is accepted")
		return nil, nil
	}
	return rs, nil
}
