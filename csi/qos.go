package csi

import (
	"fmt"
	"maps"
	"math"
	"slices"
	"strconv"
)

// QoS: ceph-csi's (≥ 3.14) StorageClass and VolumeAttributesClass
// parameters for librbd's per-image limits. Each of six families (iops,
// read iops, write iops, bps, read bps, write bps) has a base, a max and
// a per-GiB parameter; baseVolSizeBytes is shared:
//
//	limit = base + ⌊(size − baseVolSizeBytes) / GiB⌋ × perGiB, at most max
//
// with the per-GiB part only when both perGiB and baseVolSizeBytes are
// set and the volume is larger, as ceph-csi computes it. The limits go
// into image metadata as librbd config overrides (conf_rbd_qos_*), which
// an open image (the node daemon's) rereads on its own refresh: a change
// holds on a mapped volume without a remap. The inputs are kept in the
// image's metadata under ceph-csi's keys, so an expand recomputes the
// limits, and a volume ceph-csi made keeps its policy here.
//
// Where ceph-csi silently ignores a parameter, this refuses it or gives
// it a meaning: a max alone is a flat limit (ceph-csi: ignored); a
// perGiB without its base is InvalidArgument (ceph-csi: ignored); a base
// above its max is InvalidArgument (ceph-csi: base alone wins on small
// volumes, max on large ones). 0 means no limit (as for librbd), so a
// modify to "0" or "" removes a parameter.

// qosFamily names one limit's parameters; the metadata keys follow from
// its librbd name (rbd_qos_<name>_limit).
type qosFamily struct{ base, max, perGiB, name string }

var qosFamilies = []qosFamily{
	{"baseIops", "maxIops", "iopsPerGiB", "iops"},
	{"baseReadIops", "maxReadIops", "readIopsPerGiB", "read_iops"},
	{"baseWriteIops", "maxWriteIops", "writeIopsPerGiB", "write_iops"},
	{"baseBps", "maxBps", "bpsPerGiB", "bps"},
	{"baseReadBps", "maxReadBps", "readBpsPerGiB", "read_bps"},
	{"baseWriteBps", "maxWriteBps", "writeBpsPerGiB", "write_bps"},
}

const qosBaseVolSize = "baseVolSizeBytes"

// confKey is the librbd config override in image metadata.
func (f qosFamily) confKey() string { return "conf_rbd_qos_" + f.name + "_limit" }

// inputKeys are ceph-csi's metadata keys for the saved parameters.
func (f qosFamily) inputKeys() map[string]string {
	return map[string]string{
		f.base:   "rbd_base_qos_" + f.name + "_limit",
		f.max:    "rbd_max_qos_" + f.name + "_limit",
		f.perGiB: "rbd_" + f.name + "_per_gib_limit",
	}
}

// qosMetaKeys maps every QoS parameter to its metadata key.
var qosMetaKeys = func() map[string]string {
	m := map[string]string{qosBaseVolSize: "rbd_base_qos_vol_size"}
	for _, f := range qosFamilies {
		maps.Copy(m, f.inputKeys())
	}
	return m
}()

func isQoSParam(k string) bool { _, ok := qosMetaKeys[k]; return ok }

// qos is a volume's QoS parameters by name; unset ones are absent.
type qos map[string]uint64

// set parses one parameter: a whole number of IOPS, bytes/s or bytes;
// "" or "0" unsets it (baseVolSizeBytes keeps a 0).
func (q qos) set(k, v string) error {
	if !isQoSParam(k) {
		return fmt.Errorf("unknown QoS parameter %q", k)
	}
	if v == "" {
		delete(q, k)
		return nil
	}
	n, err := strconv.ParseUint(v, 10, 64)
	if err != nil {
		return fmt.Errorf("parameter %q: %q is not a whole number ≥ 0", k, v)
	}
	if n == 0 && k != qosBaseVolSize {
		delete(q, k)
		return nil
	}
	q[k] = n
	return nil
}

// with is q changed by params (a VolumeAttributesClass's): each key
// given replaces, the others stay, as the CSI spec asks of a modify.
// Anything but a QoS parameter is refused.
func (q qos) with(params map[string]string) (qos, error) {
	out := maps.Clone(q)
	if out == nil {
		out = qos{}
	}
	if err := out.apply(params); err != nil {
		return nil, err
	}
	return out, out.validate()
}

// apply sets each of params, in a fixed order (the first bad one is
// named).
func (q qos) apply(params map[string]string) error {
	for _, k := range slices.Sorted(maps.Keys(params)) {
		if err := q.set(k, params[k]); err != nil {
			return err
		}
	}
	return nil
}

// validate refuses what would be silently ignored or contradicts itself.
func (q qos) validate() error {
	for _, f := range qosFamilies {
		base, hasBase := q[f.base]
		if _, ok := q[f.perGiB]; ok && !hasBase {
			return fmt.Errorf("parameter %q needs %q", f.perGiB, f.base)
		}
		if m, ok := q[f.max]; ok && hasBase && base > m {
			return fmt.Errorf("parameter %q (%d) is above %q (%d)", f.base, base, f.max, m)
		}
	}
	return nil
}

// limits are the librbd limits for a volume of size bytes, by config
// override key; families without parameters have none.
func (q qos) limits(size uint64) map[string]uint64 {
	out := map[string]uint64{}
	for _, f := range qosFamilies {
		base, perGiB, maxL := q[f.base], q[f.perGiB], q[f.max]
		if base == 0 {
			if maxL > 0 {
				out[f.confKey()] = maxL
			}
			continue
		}
		l := base
		if bv, ok := q[qosBaseVolSize]; ok && perGiB > 0 && size > bv {
			l = addSat(l, mulSat((size-bv)>>30, perGiB))
		}
		if maxL > 0 && l > maxL {
			l = maxL
		}
		out[f.confKey()] = l
	}
	return out
}

func mulSat(a, b uint64) uint64 {
	if b != 0 && a > math.MaxUint64/b {
		return math.MaxUint64
	}
	return a * b
}

func addSat(a, b uint64) uint64 {
	if a > math.MaxUint64-b {
		return math.MaxUint64
	}
	return a + b
}

// qosFromMeta reads the saved parameters from an image's metadata.
func qosFromMeta(meta map[string]string) (qos, error) {
	q := qos{}
	for k, mk := range qosMetaKeys {
		if v, ok := meta[mk]; ok {
			if err := q.set(k, v); err != nil {
				return nil, fmt.Errorf("image metadata %q: %w", mk, err)
			}
		}
	}
	return q, nil
}

// qosChanges are the metadata writes that take an image from meta to
// q's parameters and limits at size. Limits of families neither the old
// nor the new parameters touch are left alone (an admin's own
// `rbd config image set`).
func qosChanges(meta map[string]string, q qos, size uint64) (set map[string]string, rm []string) {
	want := map[string]string{}
	for k, n := range q {
		want[qosMetaKeys[k]] = strconv.FormatUint(n, 10)
	}
	for k, n := range q.limits(size) {
		want[k] = strconv.FormatUint(n, 10)
	}
	var keys []string
	for _, f := range qosFamilies {
		ks := slices.Collect(maps.Values(f.inputKeys()))
		if slices.ContainsFunc(ks, func(k string) bool { _, ok := meta[k]; return ok }) || want[f.confKey()] != "" {
			keys = append(keys, f.confKey())
		}
		keys = append(keys, ks...)
	}
	keys = append(keys, qosMetaKeys[qosBaseVolSize])
	set = map[string]string{}
	for _, k := range keys {
		v, ok := want[k]
		old, had := meta[k]
		switch {
		case ok && (!had || old != v):
			set[k] = v
		case !ok && had:
			rm = append(rm, k)
		}
	}
	slices.Sort(rm)
	return set, rm
}
