package csi

import (
	"fmt"
	"sort"
	"strconv"
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
	MapOptions   mapOptions
	UnmapOptions string // accepted for compatibility; unmap takes none
}

// defaultFeatures: exclusive-lock is what lets RWO volumes map with the
// exclusive lock; object-map and fast-diff make used-bytes stats cheap.
func defaultFeatures() []string {
	return []string{"layering", "exclusive-lock", "object-map", "fast-diff", "deep-flatten"}
}

// Parameter keys the CO adds or ceph-csi's StorageClasses carry that are
// not ours to act on but must not be refused.
func ignoredParam(k string) bool {
	return strings.HasPrefix(k, "csi.storage.k8s.io/") ||
		k == "mounter" || // ceph-csi's choice of krbd or rbd-nbd: always nbd here
		k == "imageFormat" // only format 2 exists
}

// parseParams checks every parameter; an unknown one is refused by name.
func parseParams(in map[string]string) (params, error) {
	var p params
	keys := make([]string, 0, len(in))
	for k := range in {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		v := in[k]
		var err error
		switch k {
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
			p.MapOptions, err = parseMapOptions(v)
		case "unmapOptions":
			p.UnmapOptions = v
		case "imageFormat":
			if v != "2" {
				err = fmt.Errorf("only image format 2 is supported")
			}
		default:
			if !ignoredParam(k) {
				return p, fmt.Errorf("unknown parameter %q", k)
			}
		}
		if err != nil {
			return p, fmt.Errorf("parameter %q: %w", k, err)
		}
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

// mapOptions are the nbd part of ceph-csi's "krbd:...;nbd:..." map
// options: rbd-nbd's own option names, comma-separated, as `rbd device
// map -o` passes them.
type mapOptions struct {
	Raw             string // the nbd part, kept for the volume context
	Connections     int
	IOTimeout       *time.Duration
	ReattachTimeout *time.Duration
	NoTrim          bool
	BlockSize       uint64
	MaxSectorsKB    int
}

// parseMapOptions takes "nbd:a=1,b;krbd:x" or a bare "a=1,b" (the nbd
// mounter's options, as ceph-csi reads a value without a prefix when the
// mounter is rbd-nbd).
func parseMapOptions(s string) (mapOptions, error) {
	o := mapOptions{}
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
			return o, fmt.Errorf("unknown mounter %q in %q (want krbd: or nbd:)", kind, part)
		}
	}
	o.Raw = nbdPart
	for _, opt := range strings.Split(nbdPart, ",") {
		opt = strings.TrimSpace(opt)
		if opt == "" {
			continue
		}
		k, v, hasV := strings.Cut(opt, "=")
		num := func() (int, error) {
			n, err := strconv.Atoi(v)
			if !hasV || err != nil || n < 0 {
				return 0, fmt.Errorf("option %q wants a number", k)
			}
			return n, nil
		}
		secs := func() (*time.Duration, error) {
			n, err := num()
			d := time.Duration(n) * time.Second
			return &d, err
		}
		var err error
		switch k {
		case "try-netlink":
			// Always: netlink first, ioctls as the fallback.
		case "connections":
			o.Connections, err = num()
		case "io-timeout", "timeout":
			o.IOTimeout, err = secs()
		case "reattach-timeout":
			o.ReattachTimeout, err = secs()
		case "notrim":
			o.NoTrim = true
		case "block-size":
			var n int
			n, err = num()
			o.BlockSize = uint64(n)
		case "max-sectors-kb":
			o.MaxSectorsKB, err = num()
		default:
			err = fmt.Errorf("unknown nbd map option %q (known: try-netlink, connections, io-timeout, "+
				"reattach-timeout, notrim, block-size, max-sectors-kb)", k)
		}
		if err != nil {
			return o, err
		}
	}
	// The same check the daemon applies, now, not at the first stage.
	rec := control.Record{Index: control.AnyIndex, Spec: "rbd/x", Connections: max(o.Connections, 1),
		BlockSize: o.BlockSize, MaxSectorsKB: o.MaxSectorsKB}
	if err := rec.Validate(); err != nil {
		return o, err
	}
	return o, nil
}

// ceph-csi's defaults for a CSI map: a restarted node plugin has five
// minutes to take a device back, and I/O never times out (a timed-out
// request fails the filesystem; ceph-csi #2204).
const (
	defaultReattachTimeout = 300 * time.Second
	defaultIOTimeout       = 0
)

// apply sets the options on a device record, over ceph-csi's defaults.
func (o mapOptions) apply(rec *control.Record, defaultConns int) {
	rec.Connections = defaultConns
	if o.Connections > 0 {
		rec.Connections = o.Connections
	}
	rec.ReattachTimeout, rec.IOTimeout = defaultReattachTimeout, defaultIOTimeout
	if o.ReattachTimeout != nil {
		rec.ReattachTimeout = *o.ReattachTimeout
	}
	if o.IOTimeout != nil {
		rec.IOTimeout = *o.IOTimeout
	}
	rec.NoTrim = o.NoTrim
	if o.BlockSize > 0 {
		rec.BlockSize = o.BlockSize
	}
	if o.MaxSectorsKB > 0 {
		rec.MaxSectorsKB = o.MaxSectorsKB
	}
}
