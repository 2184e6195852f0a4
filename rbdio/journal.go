package rbdio

import (
	"fmt"
	"syscall"

	"github.com/ceph/go-ceph/rados"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
)

// A journal is the omap of one RADOS object in a pool (and namespace):
// the CSI controller keeps its snapshot names, pending flattens and
// deleted-but-kept images there, so that any controller replica, and
// the same one after a restart, finds them again. Each update is one
// atomic write operation on the object.

// ReadJournal returns the values of keys that exist in the journal
// object oid of spec's pool and namespace (spec.Image is ignored). A
// missing object reads as empty.
func (c *Clusters) ReadJournal(o ceph.Options, spec ceph.ImageSpec, oid string, keys []string) (map[string]string, error) {
	ioctx, release, err := c.ioctx(o, spec)
	if err != nil {
		return nil, err
	}
	defer release()
	op := rados.CreateReadOp()
	defer op.Release()
	step := op.GetOmapValuesByKeys(keys)
	if err := op.Operate(ioctx, oid, rados.OperationNoFlag); err != nil {
		if cephErrno(err) == syscall.ENOENT {
			return map[string]string{}, nil
		}
		return nil, fmt.Errorf("read %s in pool %s: %w", oid, spec.Pool, classify(err))
	}
	out := map[string]string{}
	for {
		kv, err := step.Next()
		if err != nil {
			return nil, fmt.Errorf("read %s in pool %s: %w", oid, spec.Pool, err)
		}
		if kv == nil {
			return out, nil
		}
		out[kv.Key] = string(kv.Value)
	}
}

// ListJournal returns every key of the journal object with prefix.
func (c *Clusters) ListJournal(o ceph.Options, spec ceph.ImageSpec, oid, prefix string) (map[string]string, error) {
	ioctx, release, err := c.ioctx(o, spec)
	if err != nil {
		return nil, err
	}
	defer release()
	// The OSD returns at most osd_max_omap_entries_per_request keys a
	// read: page through them.
	kv, err := ioctx.GetAllOmapValues(oid, "", prefix, 512)
	if err != nil {
		if cephErrno(err) == syscall.ENOENT {
			return map[string]string{}, nil
		}
		return nil, fmt.Errorf("list %s in pool %s: %w", oid, spec.Pool, classify(err))
	}
	out := make(map[string]string, len(kv))
	for k, v := range kv {
		out[k] = string(v)
	}
	return out, nil
}

// UpdateJournal sets and removes keys of the journal object in one
// atomic operation, creating the object if needed.
func (c *Clusters) UpdateJournal(o ceph.Options, spec ceph.ImageSpec, oid string, set map[string]string, rm []string) error {
	ioctx, release, err := c.ioctx(o, spec)
	if err != nil {
		return err
	}
	defer release()
	op := rados.CreateWriteOp()
	defer op.Release()
	op.Create(rados.CreateIdempotent)
	if len(set) > 0 {
		pairs := make(map[string][]byte, len(set))
		for k, v := range set {
			pairs[k] = []byte(v)
		}
		op.SetOmap(pairs)
	}
	if len(rm) > 0 {
		op.RmOmapKeys(rm)
	}
	if err := op.Operate(ioctx, oid, rados.OperationNoFlag); err != nil {
		return fmt.Errorf("update %s in pool %s: %w", oid, spec.Pool, classify(err))
	}
	return nil
}
