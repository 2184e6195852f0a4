package control

import (
	"encoding/json"
	"runtime"
	"strings"
	"testing"
	"time"
)

func TestParseMapOptions(t *testing.T) {
	def := MapOptions{Connections: 4, ReattachTimeout: 300 * time.Second, MaxSectorsKB: 4096}
	for _, tc := range []struct {
		in   string
		want func(*MapOptions)
	}{
		{"", func(*MapOptions) {}},
		{" try-netlink , ", func(*MapOptions) {}},
		{"connections=3,io-timeout=7", func(o *MapOptions) { o.Connections, o.IOTimeout = 3, 7*time.Second }},
		{"timeout=5", func(o *MapOptions) { o.IOTimeout = 5 * time.Second }},
		// A zero count or size keeps the default; a zero timeout is zero.
		{"connections=0,block-size=0,max-sectors-kb=0", func(*MapOptions) {}},
		{"reattach-timeout=0", func(o *MapOptions) { o.ReattachTimeout = 0 }},
		{"reattach-timeout=60,notrim,block-size=512,max-sectors-kb=1024", func(o *MapOptions) {
			o.ReattachTimeout, o.NoTrim, o.BlockSize, o.MaxSectorsKB = time.Minute, true, 512, 1024
		}},
	} {
		want := def
		tc.want(&want)
		if got, err := ParseMapOptions(tc.in, def); err != nil || got != want {
			t.Errorf("%q: got %+v, %v; want %+v", tc.in, got, err, want)
		}
	}
	for in, says := range map[string]string{
		"warp=9":          `unknown nbd map option "warp"`,
		"connections":     `option "connections" wants a number`,
		"connections=x":   `option "connections" wants a number`,
		"io-timeout=-1":   `option "io-timeout" wants a number`,
		"connections=99":  "connections 99: want 1 to 64",
		"block-size=3000": "block size 3000",
	} {
		if _, err := ParseMapOptions(in, def); err == nil || !strings.Contains(err.Error(), says) {
			t.Errorf("%q: got %v, want %q", in, err, says)
		}
	}
	// The defaults are checked too: they are what the device gets.
	if _, err := ParseMapOptions("notrim", MapOptions{}); err == nil || !strings.Contains(err.Error(), "connections 0") {
		t.Errorf("options over defaults without connections: %v", err)
	}
}

func TestMapOptionsValidate(t *testing.T) {
	ok := MapOptions{Connections: 1}
	if err := ok.Validate(); err != nil {
		t.Fatal(err)
	}
	for want, mod := range map[string]func(*MapOptions){
		"connections 0":        func(o *MapOptions) { o.Connections = 0 },
		"connections 65":       func(o *MapOptions) { o.Connections = 65 },
		"timeouts cannot be":   func(o *MapOptions) { o.ReattachTimeout = -time.Second },
		"block size 256":       func(o *MapOptions) { o.BlockSize = 256 },
		"block size 8192":      func(o *MapOptions) { o.BlockSize = 8192 },
		"max sectors -1 KiB":   func(o *MapOptions) { o.MaxSectorsKB = -1 },
		"power of two from 51": func(o *MapOptions) { o.BlockSize = 1536 },
		"timeouts cannot be ":  func(o *MapOptions) { o.ResendInterval = -time.Second },
		"want at least 1s":     func(o *MapOptions) { o.ResendInterval = time.Millisecond },
		"needs io-timeout 0 and 1 connection (have 8s and 1)": func(o *MapOptions) {
			o.ResendInterval, o.IOTimeout = time.Second, 8*time.Second
		},
		"needs io-timeout 0 and 1 connection (have 0s and 2)": func(o *MapOptions) {
			o.ResendInterval, o.Connections = time.Second, 2
		},
	} {
		o := ok
		mod(&o)
		if err := o.Validate(); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: got %v", want, err)
		}
	}
}

// TestParseResendInterval: a default resend interval gives way to
// options that rule it out; one the options give does not.
func TestParseResendInterval(t *testing.T) {
	def := MapOptions{Connections: 1, ReattachTimeout: 300 * time.Second, ResendInterval: 3 * time.Second}
	for in, want := range map[string]MapOptions{
		"":                  def,
		"resend-interval=5": {Connections: 1, ReattachTimeout: 300 * time.Second, ResendInterval: 5 * time.Second},
		"resend-interval=0": {Connections: 1, ReattachTimeout: 300 * time.Second},
		"connections=2":     {Connections: 2, ReattachTimeout: 300 * time.Second},
		"io-timeout=8":      {Connections: 1, ReattachTimeout: 300 * time.Second, IOTimeout: 8 * time.Second},
		"io-timeout=0":      def,
		"connections=1,notrim": {Connections: 1, ReattachTimeout: 300 * time.Second, ResendInterval: 3 * time.Second,
			NoTrim: true},
	} {
		if got, err := ParseMapOptions(in, def); err != nil || got != want {
			t.Errorf("%q: got %+v, %v; want %+v", in, got, err, want)
		}
	}
	for _, in := range []string{"resend-interval=3,connections=2", "io-timeout=8,resend-interval=3"} {
		if _, err := ParseMapOptions(in, def); err == nil || !strings.Contains(err.Error(), "resend-interval needs") {
			t.Errorf("%q: got %v", in, err)
		}
	}
}

func TestCLIDefaults(t *testing.T) {
	d := CLIDefaults()
	if d.Connections != runtime.NumCPU() || d.BlockSize != 4096 || d.IOTimeout != 0 ||
		d.ReattachTimeout != 30*time.Second || d.MaxSectorsKB != 4096 {
		t.Fatalf("CLI defaults %+v", d)
	}
	if runtime.NumCPU() <= MaxConnections {
		if err := d.Validate(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestRecordJSON: the embedded options are keys of the record itself,
// so records saved before MapOptions existed still load.
func TestRecordJSON(t *testing.T) {
	saved := `{"index": 3, "spec": "rbd/img", "cookie": "c", "read_only": true, "exclusive": true,
		"notrim": true, "connections": 4, "block_size": 512, "io_timeout": 7000000000,
		"reattach_timeout": 300000000000, "max_sectors_kb": 4096, "ceph": {}, "quiesce": true,
		"quiesce_hook": "/h", "detached": true}`
	var r Record
	if err := json.Unmarshal([]byte(saved), &r); err != nil {
		t.Fatal(err)
	}
	want := Record{Index: 3, Spec: "rbd/img", Cookie: "c", Detached: true, MapOptions: MapOptions{ReadOnly: true,
		Exclusive: true, NoTrim: true, Connections: 4, BlockSize: 512, IOTimeout: 7 * time.Second,
		ReattachTimeout: 300 * time.Second, MaxSectorsKB: 4096, Quiesce: true, QuiesceHook: "/h"}}
	if r != want {
		t.Fatalf("got  %+v\nwant %+v", r, want)
	}
	b, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	var keys map[string]any
	json.Unmarshal(b, &keys)
	for _, k := range []string{"read_only", "exclusive", "notrim", "connections", "block_size", "io_timeout",
		"reattach_timeout", "max_sectors_kb", "quiesce", "quiesce_hook"} {
		if _, ok := keys[k]; !ok {
			t.Errorf("%s is not a key of %s", k, b)
		}
	}
	if _, ok := keys["MapOptions"]; ok {
		t.Errorf("the options are nested: %s", b)
	}
}
