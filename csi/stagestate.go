package csi

import (
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
)

// stageRecord is what the node knows of a staged volume. It is written
// before anything else NodeStage does, because NodeUnstage gets no
// volume context: it says what to undo. It lives in the state directory
// (a hostPath on tmpfs), beside the node daemon's device records, so a
// restarted plugin finds both. It holds no secret.
type stageRecord struct {
	VolumeID    string   `json:"volume_id"`
	StagingPath string   `json:"staging_path"`
	Block       bool     `json:"block"`
	FsType      string   `json:"fs_type,omitempty"`
	MountFlags  []string `json:"mount_flags,omitempty"`
	ReadOnly    bool     `json:"read_only,omitempty"`
	// SingleWriter: SINGLE_NODE_SINGLE_WRITER, one publish at a time.
	SingleWriter bool `json:"single_writer,omitempty"`
	// Device is the mapped /dev/nbdN once step 2 is done.
	Device string `json:"device,omitempty"`
	// Published are the target paths NodePublish bound.
	Published []string `json:"published,omitempty"`
}

// stageTarget is where the volume is staged: the staging path itself for
// a filesystem; a file in it, bound to the device, for raw block.
func (r stageRecord) stageTarget() string {
	if r.Block {
		return filepath.Join(r.StagingPath, blockFile)
	}
	return r.StagingPath
}

// blockFile is the staged raw-block volume inside the staging path.
const blockFile = "device"

func (r *stageRecord) publish(target string) {
	if !slices.Contains(r.Published, target) {
		r.Published = append(r.Published, target)
	}
}

func (r *stageRecord) unpublish(target string) {
	r.Published = slices.DeleteFunc(r.Published, func(p string) bool { return p == target })
}

// stageStore keeps one JSON file per staged volume.
type stageStore struct{ dir string }

func openStageStore(stateDir string) (*stageStore, error) {
	dir := filepath.Join(stateDir, "csi", "volumes")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("stage state: %w", err)
	}
	return &stageStore{dir: dir}, nil
}

func (s *stageStore) path(volID string) string {
	return filepath.Join(s.dir, fmt.Sprintf("%x.json", sha256.Sum256([]byte(volID))))
}

// load returns the record of volID; ok is false if there is none.
func (s *stageStore) load(volID string) (stageRecord, bool, error) {
	b, err := os.ReadFile(s.path(volID))
	if errors.Is(err, os.ErrNotExist) {
		return stageRecord{}, false, nil
	}
	if err != nil {
		return stageRecord{}, false, err
	}
	var r stageRecord
	if err := json.Unmarshal(b, &r); err != nil {
		return r, false, fmt.Errorf("stage record of %s: %w", volID, err)
	}
	return r, true, nil
}

// save writes r atomically (temp file, fsync, rename).
func (s *stageStore) save(r stageRecord) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	tmp, err := os.CreateTemp(s.dir, ".tmp-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err = tmp.Write(b); err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), s.path(r.VolumeID))
	}
	return err
}

func (s *stageStore) remove(volID string) error {
	if err := os.Remove(s.path(volID)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}
