package control

import (
	"errors"
	"fmt"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
	"github.com/rbd-nbd-go/rbd-nbd-go/devspec"
)

// AnyIndex in Record.Index lets the kernel choose (or create) the device.
const AnyIndex = -1

// MaxConnections bounds the sockets (kernel queues) of one device.
const MaxConnections = 64

// Record is everything needed to serve a device again after a restart.
// It holds the Ceph key (the keyfile it came from is often gone by then),
// so records are written 0600 in a 0700 directory under /run: root only,
// never on disk.
type Record struct {
	Index  int    `json:"index"`
	Spec   string `json:"spec"`
	Cookie string `json:"cookie"`

	ReadOnly  bool `json:"read_only,omitempty"`
	Exclusive bool `json:"exclusive,omitempty"`
	NoTrim    bool `json:"notrim,omitempty"`

	Connections     int           `json:"connections"`
	BlockSize       uint64        `json:"block_size"`
	IOTimeout       time.Duration `json:"io_timeout"`
	ReattachTimeout time.Duration `json:"reattach_timeout"`
	MaxSectorsKB    int           `json:"max_sectors_kb,omitempty"`

	Ceph       ceph.Options    `json:"ceph"`
	Encryption ceph.Encryption `json:"encryption,omitzero"`
	Quiesce    bool            `json:"quiesce,omitempty"`
	// QuiesceHook runs as HOOK DEVICE quiesce|unquiesce; empty means
	// fsfreeze of the filesystem mounted on the device.
	QuiesceHook string `json:"quiesce_hook,omitempty"`

	// Detached devices keep their kernel side (waiting for a reattach)
	// but are not served, and a restart does not reattach them.
	Detached bool `json:"detached,omitempty"`
}

// Device is the device node path.
func (r Record) Device() string { return fmt.Sprintf("/dev/nbd%d", r.Index) }

// Public is r without its secrets: what may leave the daemon or be logged.
func (r Record) Public() Record {
	r.Ceph.Key = ""
	r.Encryption.Passphrase = ""
	return r
}

// Defaults fills what a caller left unset.
func (r *Record) Defaults() {
	if r.Connections <= 0 {
		r.Connections = 1
	}
	if r.BlockSize == 0 {
		r.BlockSize = 4096
	}
	if r.ReattachTimeout <= 0 {
		r.ReattachTimeout = 30 * time.Second
	}
}

// Validate checks a map or attach request before any device or image is
// touched. It is the one check every client goes through: the client
// runs it to fail fast, and the daemon runs it again on what it
// receives. Connections must be given; a zero block size or reattach
// timeout means the default.
func (r Record) Validate() error {
	if r.Index < AnyIndex {
		return fmt.Errorf("bad device index %d", r.Index)
	}
	if r.Connections < 1 || r.Connections > MaxConnections {
		return fmt.Errorf("connections %d: want 1 to %d", r.Connections, MaxConnections)
	}
	if r.IOTimeout < 0 || r.ReattachTimeout < 0 {
		return errors.New("timeouts cannot be negative")
	}
	if b := r.BlockSize; b != 0 && (b&(b-1) != 0 || b < 512 || b > 4096) {
		return fmt.Errorf("block size %d: want a power of two from 512 to 4096", b)
	}
	if r.MaxSectorsKB < 0 {
		return fmt.Errorf("max sectors %d KiB cannot be negative", r.MaxSectorsKB)
	}
	sp, err := devspec.Parse(r.Spec)
	if err != nil {
		return err
	}
	if !sp.IsRBD() && (r.Exclusive || r.Encryption.Format != "") {
		return errors.New("exclusive lock and encryption apply to RBD images only")
	}
	if r.Encryption != (ceph.Encryption{}) {
		if r.Encryption.Format == "" {
			return errors.New("an encryption passphrase needs an encryption format")
		}
		if err := r.Encryption.Validate(); err != nil {
			return err
		}
	}
	return nil
}
