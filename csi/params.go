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
// What was in flight when a daemon died is sent again only when the
// block layer's timer on it fires, so that timer bounds the stall of a
// kill -9 or a restart without handover (ceph-csi's io-timeout 0 leaves
// it at 30 s). Where the kernel can (resend: Linux 5.7+), a map has one
// connection, NBD's own timeout 0 and the timer at the resend interval:
// a request is then sent again only once its socket was replaced, never
// because the backend is slow (an OSD failing over), so the timer can
// be short. Otherwise (older kernels, or more connections) the timer is
// NBD's io-timeout of 8 s, which also resends slow requests: a retried
// write is held behind an overlapping first copy still in librbd (nbd
// stale gate, from half the timer), and a dead daemon's writes are
// fenced (blocklist) before its successor serves, in both modes.
func csiMapDefaults(connections int, resend bool) control.MapOptions {
	o := control.MapOptions{Connections: connections, IOTimeout: csiIOTimeout, ReattachTimeout: 300 * time.Second,
		MaxSectorsKB: 4096}
	if resend && connections == 1 {
		o.IOTimeout, o.ResendInterval = 0, csiResendInterval
	}
	return o
}

// csiIOTimeout is the kernel request timeout of CSI maps that cannot
// have a resend interval. 8 s, not 6: at 6 a backend slower than the
// timer had the same write retried for minutes (docs/csi.md).
const csiIOTimeout = 8 * time.Second

// csiResendInterval is the block layer's timer of CSI maps that resend.
// What a killed daemon had read is sent again at the first tick after
// its successor replaced the socket, so a tick quantizes the stall:
// 2 s cut a plugin+daemon kill -9's median wait from 6.7 to 5.4 s
// against 3 s (1 s: 5.3 s) in one VM. Each tick costs a "Possible stuck
// request" kernel line per request the backend holds longer (1.8 times
// the lines of 3 s; 1 s, 2.7 times). docs/csi.md has the runs.
const csiResendInterval = 2 * time.Second

// mapDefaults are the options of a map whose StorageClass sets none.
func (d *Driver) mapDefaults() control.MapOptions {
	return csiMapDefaults(d.cfg.Connections, d.cfg.NBDResends)
}

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
// names, as control.ParseMapOptions reads them) over defaults. Options
// asking for more connections over defaults with a resend interval get
// the 8 s timer those defaults would have had (unless they set their
// own io-timeout), not the kernel's 30 s.
func parseMapOptions(s string, defaults control.MapOptions) (control.MapOptions, error) {
	part, err := nbdMapOptions(s)
	if err != nil {
		return defaults, err
	}
	o, err := control.ParseMapOptions(part, defaults)
	if err == nil && defaults.ResendInterval > 0 && o.ResendInterval == 0 && o.Connections > 1 {
		multi := defaults
		multi.IOTimeout, multi.ResendInterval = csiIOTimeout, 0
		return control.ParseMapOptions(part, multi)
	}
	return o, err
}
