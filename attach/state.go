package attach

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
)

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

// Store keeps one JSON file per device.
type Store struct{ dir string }

// OpenStore uses (and creates) dir/devices.
func OpenStore(dir string) (*Store, error) {
	d := filepath.Join(dir, "devices")
	if err := os.MkdirAll(d, 0o700); err != nil {
		return nil, fmt.Errorf("state directory: %w", err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return nil, fmt.Errorf("state directory: %w", err)
	}
	return &Store{dir: d}, nil
}

func (s *Store) path(index int) string { return filepath.Join(s.dir, fmt.Sprintf("nbd%d.json", index)) }

// Save writes r atomically (temp file, fsync, rename).
func (s *Store) Save(r Record) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	tmp, err := os.CreateTemp(s.dir, ".tmp-*")
	if err != nil {
		return fmt.Errorf("save state: %w", err)
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(b); err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), s.path(r.Index))
	}
	if err != nil {
		return fmt.Errorf("save state of %s: %w", r.Device(), err)
	}
	return nil
}

// Remove forgets a device.
func (s *Store) Remove(index int) error {
	if err := os.Remove(s.path(index)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// Load reads every record, by device index.
func (s *Store) Load() ([]Record, error) {
	ents, err := os.ReadDir(s.dir)
	if err != nil {
		return nil, err
	}
	var out []Record
	for _, e := range ents {
		if !strings.HasSuffix(e.Name(), ".json") || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		b, err := os.ReadFile(filepath.Join(s.dir, e.Name()))
		if err != nil {
			return nil, err
		}
		var r Record
		if err := json.Unmarshal(b, &r); err != nil {
			return nil, fmt.Errorf("state file %s: %w", e.Name(), err)
		}
		out = append(out, r)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Index < out[j].Index })
	return out, nil
}

func sortRecords(rs []Record) {
	sort.Slice(rs, func(i, j int) bool { return rs[i].Index < rs[j].Index })
}
