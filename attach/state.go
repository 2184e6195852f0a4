package attach

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/rbd-nbd-go/rbd-nbd-go/control"
)

// Store keeps one JSON file per device.
type Store struct{ dir string }

// OpenStore uses (and creates) dir/devices.
func OpenStore(dir string) (*Store, error) {
	d := control.RecordsDir(dir)
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
func (s *Store) Save(r control.Record) error {
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
func (s *Store) Load() ([]control.Record, error) {
	ents, err := os.ReadDir(s.dir)
	if err != nil {
		return nil, err
	}
	var out []control.Record
	for _, e := range ents {
		if !strings.HasSuffix(e.Name(), ".json") || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		b, err := os.ReadFile(filepath.Join(s.dir, e.Name()))
		if err != nil {
			return nil, err
		}
		var r control.Record
		if err := json.Unmarshal(b, &r); err != nil {
			return nil, fmt.Errorf("state file %s: %w", e.Name(), err)
		}
		out = append(out, r)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Index < out[j].Index })
	return out, nil
}

func sortRecords(rs []control.Record) {
	sort.Slice(rs, func(i, j int) bool { return rs[i].Index < rs[j].Index })
}
