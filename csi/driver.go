package csi

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"k8s.io/mount-utils"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
	"github.com/rbd-nbd-go/rbd-nbd-go/control"
)

// DefaultDriverName is the CSI driver name unless --drivername says
// otherwise: DNS-style, ours, and distinct from ceph-csi's
// rbd.csi.ceph.com so both can run side by side during a migration.
const DefaultDriverName = "rbd-nbd-go.csi.io"

// Images is the controller's image management (rbdio.Clusters).
type Images interface {
	CreateImage(o ceph.Options, spec ceph.ImageSpec, n ceph.NewImage) error
	ImageInfo(o ceph.Options, spec ceph.ImageSpec) (ceph.ImageInfo, error)
	ImageName(o ceph.Options, ref ceph.ImageRef) (string, error)
	ResizeImage(o ceph.Options, spec ceph.ImageSpec, size uint64) error
	RemoveImage(o ceph.Options, spec ceph.ImageSpec) error
	RenameImage(o ceph.Options, spec ceph.ImageSpec, name string) error
	UpdateMetadata(o ceph.Options, spec ceph.ImageSpec, set map[string]string, rm []string) error
	ListImages(o ceph.Options, spec ceph.ImageSpec, metaKey string) ([]ceph.ImageInfo, error)
	ListPools(o ceph.Options) ([]string, error)
	PoolAvailable(o ceph.Options, pool string) (uint64, error)
	// FormatEncryption writes a LUKS2 header with passphrase on an
	// image that holds no data yet.
	FormatEncryption(o ceph.Options, spec ceph.ImageSpec, passphrase []byte) error
	Snapshots
	Journals
}

// Snapshots are the controller's snapshot, clone and flatten calls
// (rbdio.Clusters).
type Snapshots interface {
	CreateSnapshot(o ceph.Options, spec ceph.ImageSpec, name string, q ceph.Quiesce) (ceph.SnapshotOf, error)
	GetSnapshot(o ceph.Options, ref ceph.ImageRef, snapID uint64) (ceph.SnapshotOf, error)
	ListSnapshots(o ceph.Options, spec ceph.ImageSpec) ([]ceph.Snapshot, error)
	RemoveSnapshot(o ceph.Options, ref ceph.ImageRef, snapID uint64) error
	Children(o ceph.Options, ref ceph.ImageRef, snapID uint64) ([]ceph.Child, error)
	CloneImage(o ceph.Options, parent, child ceph.ImageSpec, n ceph.NewImage) error
	ParentChain(o ceph.Options, ref ceph.ImageRef, snapID uint64) ([]ceph.Link, error)
	Flatten(o ceph.Options, ref ceph.ImageRef, resumed bool, stop <-chan struct{}, interval time.Duration,
		report func(done, total uint64)) error
}

// Journals are the omaps the controller journals in (rbdio.Clusters).
type Journals interface {
	ReadJournal(o ceph.Options, pool ceph.ImageSpec, oid string, keys []string) (map[string]string, error)
	ListJournal(o ceph.Options, pool ceph.ImageSpec, oid, prefix string) (map[string]string, error)
	UpdateJournal(o ceph.Options, pool ceph.ImageSpec, oid string, set map[string]string, rm []string) error
}

// NodeDaemon is the node service's client of the node daemon
// (control.Client).
type NodeDaemon interface {
	Map(ctx context.Context, rec control.Record) (control.Record, error)
	UnmapCookie(ctx context.Context, target, cookie string) error
	List(ctx context.Context) (control.Listing, error)
	Status(ctx context.Context, target string, usage bool) (control.Status, error)
	Ping(ctx context.Context) error
}

// NodeRegistry says whether a node ID names a node running our node
// plugin; ControllerPublish refuses others with NotFound.
type NodeRegistry interface {
	NodeExists(ctx context.Context, nodeID string) (bool, error)
}

// CallObserver hears of each CSI call as it ends: its full gRPC method,
// its status code's name, and how long it took.
type CallObserver interface {
	ObserveCall(method, code string, took time.Duration)
}

// Config is everything the driver takes; cmd/ fills it from flags.
type Config struct {
	Name, Version string
	NodeID        string
	Controller    bool
	Node          bool
	// ClustersConfig is ceph-csi's config.json.
	ClustersConfig string
	// StateDir holds the node's stage records (csi/) beside the node
	// daemon's own state.
	StateDir string

	// Images is the controller's way to images, and the node's to an
	// encrypted volume's key (which lives in image metadata).
	Images Images
	Daemon NodeDaemon // node
	// DaemonReady, if set, is closed once the plugin's start-up take-over
	// (or start) of the node daemon has ended, either way. The plugin
	// listens before that, so the kubelet and the registrar hear from it
	// at once; until then Probe says not ready and the node's volume
	// calls wait, so none starts a daemon of its own beside that one.
	DaemonReady <-chan struct{}
	// KMSConfig is ceph-csi's KMS config file (DefaultKMSConfig if
	// empty): what a StorageClass's encryptionKMSID names.
	KMSConfig string
	// Mounter formats and mounts (node); its Exec also runs resize
	// tools.
	Mounter *mount.SafeFormatAndMount
	// Nodes, if set, is checked by ControllerPublish; nil accepts any
	// node ID (Kubernetes' attacher only publishes to nodes whose
	// CSINode lists this driver).
	Nodes NodeRegistry
	// Connections per device unless the StorageClass's map options say;
	// 0 means 1 where the kernel resends (NBDResends), else min(CPUs, 4)
	// and never fewer than 2: before Linux 5.7 a one-connection device
	// could not take a new socket, so a plugin restart would hang it.
	Connections int
	// NBDResends: the node's kernel sends a request again once its
	// socket is replaced, on a one-connection device whose NBD timeout is
	// 0 (kernel.ResendsOnNewSocket). One-connection maps then get a
	// resend interval instead of an NBD timeout (csiMapDefaults).
	NBDResends bool
	// ControllerSecretDir, if set, holds userID and userKey files (a
	// mounted Secret, ceph-csi's key names): the credentials for the
	// calls that carry none (ListVolumes, GetCapacity,
	// ControllerPublish), from the start.
	ControllerSecretDir string
	// SlowCall: calls taking longer are logged as slow (default 10s).
	SlowCall time.Duration
	// Calls, if set, hears of every call's method, code and duration
	// (the plugin's metrics).
	Calls CallObserver
	// DeviceWait bounds NodeExpand's wait for the device to show the new
	// size (default 2 minutes).
	DeviceWait time.Duration
	// SysBlock is /sys/block unless tests move it.
	SysBlock string
	Log      *slog.Logger

	// Limits bound clone depth and snapshots per image (controller);
	// zero means DefaultLimits.
	Limits Limits
	// SweepInterval is how often the controller looks for owed
	// flattens and for deleted volumes' images nothing needs any more
	// (default 1 minute); FlattenProgress how often a running flatten
	// logs its progress (default 10 s).
	SweepInterval, FlattenProgress time.Duration
	// Flattens bounds the flattens running at once (default 2).
	Flattens int
}

// Driver implements the CSI services selected in its Config.
type Driver struct {
	csi.UnimplementedIdentityServer
	csi.UnimplementedControllerServer
	csi.UnimplementedNodeServer

	cfg      Config
	log      *slog.Logger
	clusters clusters
	locks    *keyLocks
	state    *stageStore
	flat     *flattener // controller

	// creds remembers, per clusterID, the last credentials a request
	// carried, in memory only: ListVolumes, GetCapacity and
	// ControllerPublish carry no secrets.
	credsMu sync.Mutex
	creds   map[string]credentials

	requestSeq atomic.Uint64 // request IDs in the logs
}

// New checks cfg and returns a driver.
func New(cfg Config) (*Driver, error) {
	if cfg.Name == "" {
		cfg.Name = DefaultDriverName
	}
	if !cfg.Controller && !cfg.Node {
		return nil, errors.New("neither the controller nor the node service is enabled")
	}
	if cfg.Controller && cfg.Images == nil {
		return nil, errors.New("the controller service needs image management")
	}
	if cfg.Node {
		if cfg.NodeID == "" {
			return nil, errors.New("the node service needs a node ID (--nodeid)")
		}
		if cfg.Daemon == nil || cfg.Mounter == nil {
			return nil, errors.New("the node service needs the daemon and a mounter")
		}
		if cfg.StateDir == "" {
			return nil, errors.New("the node service needs a state directory")
		}
	}
	if cfg.Connections <= 0 {
		cfg.Connections = max(2, min(runtime.NumCPU(), 4))
		if cfg.NBDResends {
			cfg.Connections = 1
		}
	}
	if cfg.SlowCall <= 0 {
		cfg.SlowCall = 10 * time.Second
	}
	if cfg.DeviceWait <= 0 {
		cfg.DeviceWait = 2 * time.Minute
	}
	if cfg.KMSConfig == "" {
		cfg.KMSConfig = DefaultKMSConfig
	}
	if cfg.SysBlock == "" {
		cfg.SysBlock = "/sys/block"
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.Limits == (Limits{}) {
		cfg.Limits = DefaultLimits()
	}
	if err := cfg.Limits.Validate(); err != nil {
		return nil, err
	}
	if cfg.SweepInterval <= 0 {
		cfg.SweepInterval = time.Minute
	}
	if cfg.FlattenProgress <= 0 {
		cfg.FlattenProgress = 10 * time.Second
	}
	if cfg.Flattens <= 0 {
		cfg.Flattens = 2
	}
	d := &Driver{cfg: cfg, log: cfg.Log, clusters: clusters{cfg.ClustersConfig}, locks: newKeyLocks(),
		creds: map[string]credentials{}}
	if cfg.Controller {
		d.flat = newFlattener(cfg.Images, cfg.Log, cfg.Flattens, cfg.FlattenProgress)
	}
	if cfg.Node {
		var err error
		if d.state, err = openStageStore(cfg.StateDir); err != nil {
			return nil, err
		}
	}
	return d, nil
}

// remember keeps the credentials that worked for vol's cluster, for the
// calls that carry none.
func (d *Driver) remember(vol volume, c credentials) {
	d.credsMu.Lock()
	d.creds[vol.ClusterID] = c
	d.credsMu.Unlock()
}

// knownCreds are the credentials for calls that carry none: the
// controller's own Secret if it has one, else the last ones a call for
// the cluster carried. Those may be another StorageClass's, so they
// only ever serve reads (listing, existence checks, free space).
func (d *Driver) knownCreds(clusterID string) (credentials, bool) {
	if c, ok := d.secretCreds(); ok {
		return c, true
	}
	d.credsMu.Lock()
	defer d.credsMu.Unlock()
	c, ok := d.creds[clusterID]
	return c, ok
}

// secretCreds reads the controller's own Secret (ControllerSecretDir).
func (d *Driver) secretCreds() (credentials, bool) {
	dir := d.cfg.ControllerSecretDir
	if dir == "" {
		return credentials{}, false
	}
	id, err1 := os.ReadFile(filepath.Join(dir, "userID"))
	key, err2 := os.ReadFile(filepath.Join(dir, "userKey"))
	if err1 != nil || err2 != nil {
		d.log.Warn("controller secret unreadable", "dir", dir)
		return credentials{}, false
	}
	return credentials{ID: strings.TrimSpace(string(id)), Key: strings.TrimSpace(string(key))}, true
}

// describe is a request's volume for logs and errors.
func describe(v volume) string { return fmt.Sprintf("%s on cluster %s", v.Spec, v.ClusterID) }
