package csi

import (
	"strings"
	"testing"
	"time"
)

// TestMapOptions: ceph-csi's mounter prefixes over the CSI defaults; the
// options themselves are control.ParseMapOptions'.
func TestMapOptions(t *testing.T) {
	def := csiMapDefaults(3)
	if def.Connections != 3 || def.ReattachTimeout != 300*time.Second || def.IOTimeout != 8*time.Second ||
		def.MaxSectorsKB != 4096 || def.BlockSize != 0 {
		t.Fatalf("CSI defaults %+v", def)
	}
	for in, conns := range map[string]int{
		"":                                     3,
		"connections=5":                        5,
		"nbd:connections=5":                    5,
		"krbd:lock_on_read;nbd:connections=5":  5,
		"nbd:connections=5;krbd:connections=9": 5,
		"krbd:lock_on_read":                    3,
		" nbd: connections=6 ; krbd:queue_depth=8": 6,
	} {
		if o, err := parseMapOptions(in, def); err != nil || o.Connections != conns {
			t.Errorf("%q: %+v %v, want %d connections", in, o, err, conns)
		}
	}
	// ceph-csi's io-timeout 0 (the kernel's 30 s) is one option away.
	if o, err := parseMapOptions("nbd:io-timeout=0", def); err != nil || o.IOTimeout != 0 {
		t.Errorf("io-timeout=0: %+v %v", o, err)
	}
	for in, says := range map[string]string{
		"rbd:connections=5":  `unknown mounter "rbd"`,
		"krbd:x;nbd:warp=9":  `unknown nbd map option "warp"`,
		"nbd:connections=99": "connections 99",
	} {
		if _, err := parseMapOptions(in, def); err == nil || !strings.Contains(err.Error(), says) {
			t.Errorf("%q: got %v, want %q", in, err, says)
		}
	}
}
