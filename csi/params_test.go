package csi

import (
	"strings"
	"testing"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/control"
)

// TestMapOptions: ceph-csi's mounter prefixes over the CSI defaults; the
// options themselves are control.ParseMapOptions'.
func TestMapOptions(t *testing.T) {
	def := csiMapDefaults(3, true)
	if def.Connections != 3 || def.ReattachTimeout != 300*time.Second || def.IOTimeout != 8*time.Second ||
		def.MaxSectorsKB != 4096 || def.BlockSize != 0 || def.ResendInterval != 0 {
		t.Fatalf("CSI defaults %+v", def)
	}
	// One connection where the kernel resends: no NBD timeout, the
	// block layer's timer at 2 s; ceph-csi's connections=N or an
	// io-timeout turn that back into the 8 s timer's mode, with no error.
	one := csiMapDefaults(1, true)
	if one.Connections != 1 || one.IOTimeout != 0 || one.ResendInterval != 2*time.Second {
		t.Fatalf("CSI defaults, one connection %+v", one)
	}
	if old := csiMapDefaults(1, false); old.IOTimeout != 8*time.Second || old.ResendInterval != 0 {
		t.Fatalf("CSI defaults, one connection, old kernel %+v", old)
	}
	for in, want := range map[string]control.MapOptions{
		"nbd:connections=4": {Connections: 4, IOTimeout: 8 * time.Second, ReattachTimeout: 300 * time.Second,
			MaxSectorsKB: 4096},
		"nbd:connections=4,io-timeout=0": {Connections: 4, ReattachTimeout: 300 * time.Second, MaxSectorsKB: 4096},
		"nbd:io-timeout=8": {Connections: 1, IOTimeout: 8 * time.Second, ReattachTimeout: 300 * time.Second,
			MaxSectorsKB: 4096},
		"nbd:resend-interval=5": {Connections: 1, ResendInterval: 5 * time.Second, ReattachTimeout: 300 * time.Second,
			MaxSectorsKB: 4096},
	} {
		if o, err := parseMapOptions(in, one); err != nil || o != want {
			t.Errorf("%q over one connection: %+v %v, want %+v", in, o, err, want)
		}
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
