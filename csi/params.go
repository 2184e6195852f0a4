package csi

import (
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
	"github.com/rbd-nbd-go/rbd-nbd-go/control"
)

// params are a StorageClass's parameters, ceph-csi's names. They reach
// CreateVolume, which passes what the node needs on in the volume
// context (NodeStage gets that, not the StorageClass).
type params struct {
	ClusterID    string
	Pool         string
	DataPool     string
	Features     []string
	MkfsOptions  string
	MapOptions   string // the nbd part, checked, for the volume context
	UnmapOptions string // accepted for compatibility; unmap takes none
	QoS          qos    // qos.go
	Encryption   encryption
	// Owner is the PVC the volume is made for, when the provisioner
	// passes it (--extra-create-metadata).
	Owner owner
}

// Parameter keys the CO adds or ceph-csi's StorageClasses carry that are
// not ours to act on but must not be refused.
func ignoredParam(k string) bool {
	return strings.HasPrefix(k, "csi.storage.k8s.io/") ||
		k == "mounter" || // ceph-csi's choice of krbd or rbd-nbd: always nbd here
		k == "imageFormat" // only format 2 exists
}

// parseParams checks every parameter; an unknown one is refused by name.
// The map options are checked over mapDefaults, the node's defaults.
func parseParams(in map[string]string, mapDefaults control.MapOptions) (params, error) {
	p := params{QoS: qos{}}
	keys := make([]string, 0, len(in))
	for k := range in {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		v := in[k]
		var err error
		switch k {
		case keyPVCName:
			p.Owner.PVC = v
		case keyPVCNamespace:
			p.Owner.Namespace = v
		case keyPVName:
			p.Owner.PV = v
		case "clusterID":
			p.ClusterID = v
		case "pool":
			p.Pool = v
		case "dataPool":
			p.DataPool = v
		case "imageFeatures":
			p.Features, err = ceph.ParseFeatures(v)
		case "mkfsOptions":
			p.MkfsOptions = v
		case "mapOptions":
			if p.MapOptions, err = nbdMapOptions(v); err == nil {
				_, err = control.ParseMapOptions(p.MapOptions, mapDefaults)
			}
		case "unmapOptions":
			p.UnmapOptions = v
		case "imageFormat":
			if v != "2" {
				err = fmt.Errorf("only image format 2 is supported")
			}
		case "encrypted", "encryptionType", "encryptionKMSID":
			// parseEncryption, below, reads them together.
		default:
			if isQoSParam(k) {
				err = p.QoS.set(k, v)
			} else if !ignoredParam(k) {
				return p, fmt.Errorf("unknown parameter %q", k)
			}
		}
		if err != nil {
			return p, fmt.Errorf("parameter %q: %w", k, err)
		}
	}
	var err error
	if p.Encryption, err = parseEncryption(in); err != nil {
		return p, err
	}
	if p.ClusterID == "" {
		return p, fmt.Errorf("parameter %q is required", "clusterID")
	}
	if len(p.ClusterID) > maxClusterIDLen {
		return p, fmt.Errorf("parameter %q: longer than %d bytes", "clusterID", maxClusterIDLen)
	}
	if p.Pool == "" {
		p.Pool = "rbd"
	}
	if strings.ContainsAny(p.Pool+p.DataPool, "/@") {
		return p, fmt.Errorf("parameter %q: bad pool name", "pool")
	}
	if p.Features == nil {
		p.Features = defaultFeatures()
	}
	return p, nil
}

// csiMapDefaults are a CSI map's defaults, with the driver's connections
// per device (Config.Connections): a restarted node plugin has five
// minutes to take a device back (ceph-csi's reattach-timeout), and
// max_sectors_kb is raised to an RBD object, as the CLI raises it.
//
// The request timeout is 8 s, not ceph-csi's 0 (the kernel's 30 s).
// With two or more connections a timed-out request is never failed: the
// kernel sends it again on a live socket (or on the one the daemon, or
// its successor, gives it). What was in flight when a daemon died waits
// for exactly that timer, so it bounds the stall of a kill -9 or a
// restart without handover. Safe: a retried write is held behind an
// overlapping first copy still in librbd (nbd stale gate, marked at
// half the timeout), and a dead daemon's writes are fenced (blocklist)
// before its successor serves. The cost: a request slower than 8 s
// (an OSD failing over) is sent again, with its socket replaced,
// instead of waited for. 8 s, not 10 s: the stall after a kill -9 is the
// timer plus about a second, and the target is 10 s.
func csiMapDefaults(connections int) control.MapOptions {
	return control.MapOptions{Connections: connections, IOTimeout: csiIOTimeout, ReattachTimeout: 300 * time.Second,
		MaxSectorsKB: 4096}
}

// csiIOTimeout is the kernel request timeout of CSI maps.
const csiIOTimeout = 8 * time.Second

// mapDefaults are the options of a map whose StorageClass sets none.
func (d *Driver) mapDefaults() control.MapOptions { return csiMapDefaults(d.cfg.Connections) }

// nbdMapOptions is the nbd part of ceph-csi's map options: "krbd:...;
// nbd:..." or a bare list (the nbd mounter's options, as ceph-csi reads
// a value without a prefix when the mounter is rbd-nbd). The prefixes
// are ceph-csi's; the options themselves are rbd-nbd's.
func nbdMapOptions(s string) (string, error) {
	nbdPart := ""
	for _, part := range strings.Split(s, ";") {
		part = strings.TrimSpace(part)
		kind, rest, ok := strings.Cut(part, ":")
		switch {
		case !ok:
			nbdPart = part
		case kind == "nbd":
			nbdPart = rest
		case kind == "krbd":
			// krbd's options do not apply to nbd.
		default:
			return "", fmt.Errorf("unknown mounter %q in %q (want krbd: or nbd:)", kind, part)
		}
	}
	return nbdPart, nil
}

// parseMapOptions reads ceph-csi's map options (rbd-nbd's own option
// names, as control.ParseMapOptions reads them) over defaults.
func parseMapOptions(s string, defaults control.MapOptions) (control.MapOptions, error) {
	part, err := nbdMapOptions(s)
	if err != nil {
		return defaults, err
	}
	return control.ParseMapOptions(part, defaults)
}
