package control

import (
	"errors"
	"fmt"
	"runtime"
	"strconv"
	"strings"
	"time"
)

// MapOptions say how a device is mapped, whatever it serves: what
// rbd-nbd's map flags and ceph-csi's mapOptions set. The CLI fills them
// from its flags, the CSI node from a volume's capability and its
// StorageClass; a Record embeds them, so both reach the daemon as one
// type and are checked by one Validate.
type MapOptions struct {
	ReadOnly  bool `json:"read_only,omitempty"`
	Exclusive bool `json:"exclusive,omitempty"`
	NoTrim    bool `json:"notrim,omitempty"`

	Connections     int           `json:"connections"`
	BlockSize       uint64        `json:"block_size"`
	IOTimeout       time.Duration `json:"io_timeout"`
	ReattachTimeout time.Duration `json:"reattach_timeout"`
	MaxSectorsKB    int           `json:"max_sectors_kb,omitempty"`
	// ResendInterval, with IOTimeout 0 and one connection, is the block
	// layer's timer on the device's requests: a request still unanswered
	// when it fires is sent again only if its socket was replaced meanwhile
	// (its daemon restarted), else left waiting. So a restart costs the
	// application about this long, not the kernel's 30 s, while a slow
	// backend is never sent a request twice. 0 leaves the kernel's 30 s.
	ResendInterval time.Duration `json:"resend_interval,omitempty"`

	Quiesce bool `json:"quiesce,omitempty"`
	// QuiesceHook runs as HOOK DEVICE quiesce|unquiesce; empty means
	// fsfreeze of the filesystem mounted on the device.
	QuiesceHook string `json:"quiesce_hook,omitempty"`
}

// CLIDefaults are the map and attach commands' defaults: rbd-nbd's
// reattach timeout and no I/O timeout; one connection (kernel queue)
// per CPU; 4 KiB blocks; max_sectors_kb raised to 4 MiB, an RBD object,
// so large I/O reaches the server unsplit.
func CLIDefaults() MapOptions {
	return MapOptions{Connections: runtime.NumCPU(), BlockSize: 4096,
		IOTimeout: 0, ReattachTimeout: 30 * time.Second, MaxSectorsKB: 4096}
}

// Validate checks the options alone, whatever the device serves (the
// rest is Record.Validate's). Connections must be given; a zero block
// size or reattach timeout means the daemon's default.
func (o MapOptions) Validate() error {
	if o.Connections < 1 || o.Connections > MaxConnections {
		return fmt.Errorf("connections %d: want 1 to %d", o.Connections, MaxConnections)
	}
	if o.IOTimeout < 0 || o.ReattachTimeout < 0 || o.ResendInterval < 0 {
		return errors.New("timeouts cannot be negative")
	}
	if o.ResendInterval > 0 && (o.IOTimeout > 0 || o.Connections > 1) {
		// The kernel then sends a request again whenever the timer
		// fires, however slow the backend: a retry storm, not a resend.
		return fmt.Errorf("resend-interval needs io-timeout 0 and 1 connection (have %s and %d)",
			o.IOTimeout, o.Connections)
	}
	if o.ResendInterval > 0 && o.ResendInterval < time.Second {
		return fmt.Errorf("resend-interval %s: want at least 1s", o.ResendInterval)
	}
	if b := o.BlockSize; b != 0 && (b&(b-1) != 0 || b < 512 || b > 4096) {
		return fmt.Errorf("block size %d: want a power of two from 512 to 4096", b)
	}
	if o.MaxSectorsKB < 0 {
		return fmt.Errorf("max sectors %d KiB cannot be negative", o.MaxSectorsKB)
	}
	return nil
}

// ParseMapOptions reads rbd-nbd's comma-separated map options, as
// `rbd device map -o` passes them and ceph-csi's mapOptions carry them
// (connections=N,io-timeout=S,reattach-timeout=S,notrim,block-size=N,
// max-sectors-kb=N,try-netlink, and our resend-interval=S), over
// defaults, and checks the result. A zero count or size keeps the
// default; a zero timeout is zero. A resend interval among the defaults
// gives way to connections or an io-timeout that rule it out, as
// ceph-csi's mapOptions may set them: only one given in s is an error.
func ParseMapOptions(s string, defaults MapOptions) (MapOptions, error) {
	o := defaults
	resendGiven := false
	for _, opt := range strings.Split(s, ",") {
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
		var n int
		var err error
		switch k {
		case "try-netlink":
			// Always: netlink first, ioctls as the fallback.
		case "connections":
			if n, err = num(); n > 0 {
				o.Connections = n
			}
		case "io-timeout", "timeout":
			n, err = num()
			o.IOTimeout = time.Duration(n) * time.Second
		case "reattach-timeout":
			n, err = num()
			o.ReattachTimeout = time.Duration(n) * time.Second
		case "resend-interval":
			n, err = num()
			o.ResendInterval, resendGiven = time.Duration(n)*time.Second, true
		case "notrim":
			o.NoTrim = true
		case "block-size":
			if n, err = num(); n > 0 {
				o.BlockSize = uint64(n)
			}
		case "max-sectors-kb":
			if n, err = num(); n > 0 {
				o.MaxSectorsKB = n
			}
		default:
			err = fmt.Errorf("unknown nbd map option %q (known: try-netlink, connections, io-timeout, "+
				"reattach-timeout, resend-interval, notrim, block-size, max-sectors-kb)", k)
		}
		if err != nil {
			return defaults, err
		}
	}
	if !resendGiven && (o.IOTimeout > 0 || o.Connections > 1) {
		o.ResendInterval = 0
	}
	if err := o.Validate(); err != nil {
		return defaults, err
	}
	return o, nil
}
