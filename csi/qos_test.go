package csi

import (
	"maps"
	"math"
	"strings"
	"testing"
)

const gib = 1 << 30

func TestQoSLimits(t *testing.T) {
	for _, tc := range []struct {
		name   string
		params map[string]string
		size   uint64
		want   map[string]uint64
	}{
		{"none", nil, 10 * gib, map[string]uint64{}},
		{"base alone", map[string]string{"baseIops": "100"}, 50 * gib,
			map[string]uint64{"conf_rbd_qos_iops_limit": 100}},
		{"perGiB without baseVolSizeBytes: base alone (ceph-csi)",
			map[string]string{"baseWriteIops": "100", "writeIopsPerGiB": "10"}, 50 * gib,
			map[string]uint64{"conf_rbd_qos_write_iops_limit": 100}},
		{"at the base size", map[string]string{"baseReadBps": "1000", "readBpsPerGiB": "7", "baseVolSizeBytes": "10737418240"},
			10 * gib, map[string]uint64{"conf_rbd_qos_read_bps_limit": 1000}},
		{"below the base size", map[string]string{"baseReadBps": "1000", "readBpsPerGiB": "7", "baseVolSizeBytes": "10737418240"},
			1 * gib, map[string]uint64{"conf_rbd_qos_read_bps_limit": 1000}},
		{"per GiB above it", map[string]string{"baseBps": "1000", "bpsPerGiB": "7", "baseVolSizeBytes": "10737418240"},
			15 * gib, map[string]uint64{"conf_rbd_qos_bps_limit": 1035}},
		{"partial GiB does not count", map[string]string{"baseIops": "100", "iopsPerGiB": "10", "baseVolSizeBytes": "0"},
			3*gib + gib - 1, map[string]uint64{"conf_rbd_qos_iops_limit": 130}},
		{"capped by max", map[string]string{"baseIops": "100", "iopsPerGiB": "10", "maxIops": "150", "baseVolSizeBytes": "0"},
			100 * gib, map[string]uint64{"conf_rbd_qos_iops_limit": 150}},
		// ceph-csi's own table: 20 GiB base, 100 GiB volume.
		{"ceph-csi's example", map[string]string{"baseReadIops": "2000", "readIopsPerGiB": "20", "baseWriteBps": "104857600",
			"writeBpsPerGiB": "1048576", "baseVolSizeBytes": "21474836480"}, 100 * gib,
			map[string]uint64{"conf_rbd_qos_read_iops_limit": 3600, "conf_rbd_qos_write_bps_limit": 188743680}},
		{"max alone is a flat limit", map[string]string{"maxWriteIops": "500"}, 100 * gib,
			map[string]uint64{"conf_rbd_qos_write_iops_limit": 500}},
		{"0 is no limit", map[string]string{"baseIops": "0", "maxBps": "0"}, gib, map[string]uint64{}},
		{"saturates", map[string]string{"baseBps": "1", "bpsPerGiB": "18446744073709551615", "baseVolSizeBytes": "0"},
			8 * gib, map[string]uint64{"conf_rbd_qos_bps_limit": math.MaxUint64}},
		{"all six", map[string]string{"baseIops": "1", "baseReadIops": "2", "baseWriteIops": "3", "baseBps": "4",
			"baseReadBps": "5", "baseWriteBps": "6"}, gib, map[string]uint64{"conf_rbd_qos_iops_limit": 1,
			"conf_rbd_qos_read_iops_limit": 2, "conf_rbd_qos_write_iops_limit": 3, "conf_rbd_qos_bps_limit": 4,
			"conf_rbd_qos_read_bps_limit": 5, "conf_rbd_qos_write_bps_limit": 6}},
	} {
		q, err := (qos{}).with(tc.params)
		if err != nil {
			t.Errorf("%s: %v", tc.name, err)
			continue
		}
		if got := q.limits(tc.size); !maps.Equal(got, tc.want) {
			t.Errorf("%s: limits %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestQoSBadParameters(t *testing.T) {
	for _, tc := range []struct {
		params map[string]string
		says   string
	}{
		{map[string]string{"maxiops": "1"}, `unknown QoS parameter "maxiops"`},
		{map[string]string{"baseIops": "-1"}, `"baseIops": "-1" is not a whole number`},
		{map[string]string{"baseIops": "1.5"}, `"baseIops"`},
		{map[string]string{"baseBps": "10Mi"}, `"baseBps"`},
		{map[string]string{"baseVolSizeBytes": "1Gi"}, `"baseVolSizeBytes"`},
		{map[string]string{"iopsPerGiB": "10", "baseVolSizeBytes": "0"}, `"iopsPerGiB" needs "baseIops"`},
		{map[string]string{"baseWriteBps": "200", "maxWriteBps": "100"}, `"baseWriteBps" (200) is above "maxWriteBps" (100)`},
	} {
		_, err := (qos{}).with(tc.params)
		if err == nil || !strings.Contains(err.Error(), tc.says) {
			t.Errorf("%v: got %v, want an error saying %s", tc.params, err, tc.says)
		}
	}
}

func TestQoSMetadata(t *testing.T) {
	q, _ := (qos{}).with(map[string]string{"baseIops": "100", "iopsPerGiB": "10", "baseVolSizeBytes": "1073741824"})
	set, rm := qosChanges(nil, q, 3*gib)
	want := map[string]string{"conf_rbd_qos_iops_limit": "120", "rbd_base_qos_iops_limit": "100",
		"rbd_iops_per_gib_limit": "10", "rbd_base_qos_vol_size": "1073741824"}
	if !maps.Equal(set, want) || len(rm) != 0 {
		t.Fatalf("set %v rm %v, want set %v", set, rm, want)
	}
	// Read back, it is the same; grown, only the limit changes.
	back, err := qosFromMeta(set)
	if err != nil || !maps.Equal(back, q) {
		t.Fatalf("read back %v (%v), want %v", back, err, q)
	}
	if set, rm := qosChanges(want, back, 3*gib); len(set)+len(rm) != 0 {
		t.Errorf("nothing changed, yet set %v rm %v", set, rm)
	}
	set, rm = qosChanges(want, back, 11*gib)
	if !maps.Equal(set, map[string]string{"conf_rbd_qos_iops_limit": "200"}) || len(rm) != 0 {
		t.Errorf("grown: set %v rm %v", set, rm)
	}
	// Unset: the saved parameters and the limit go; an admin's own
	// limit of another family stays.
	have := maps.Clone(want)
	have["conf_rbd_qos_bps_limit"] = "999"
	set, rm = qosChanges(have, qos{}, 3*gib)
	if len(set) != 0 || strings.Join(rm, ",") != "conf_rbd_qos_iops_limit,rbd_base_qos_iops_limit,rbd_base_qos_vol_size,rbd_iops_per_gib_limit" {
		t.Errorf("cleared: set %v rm %v", set, rm)
	}
	if _, err := qosFromMeta(map[string]string{"rbd_max_qos_bps_limit": "x"}); err == nil ||
		!strings.Contains(err.Error(), "rbd_max_qos_bps_limit") {
		t.Errorf("bad saved value: %v", err)
	}
}
