package csi

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sort"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
)

// Snapshots live on the source volume's image: `rbd snap ls` shows them,
// and export-diff and changed-block tracking work between them (ceph-csi
// #2693 has an image per snapshot instead). A restore is a format-2
// clone of the snapshot; the snapshot can be deleted while restores
// live (librbd keeps it in the trash namespace until they go), and the
// volume while its snapshots live (its image is renamed out of the way,
// csi-gone-ID, and removed with its last snapshot or clone). See the
// README's "Snapshots and clones" for the layout and its reasons.

// snapParams are a VolumeSnapshotClass's parameters, ceph-csi's names.
type snapParams struct {
	ClusterID string
	Prefix    string // snapshotNamePrefix
}

func parseSnapParams(in map[string]string) (snapParams, error) {
	p := snapParams{Prefix: defaultSnapPrefix}
	for _, k := range slices.Sorted(maps.Keys(in)) {
		v := in[k]
		switch {
		case k == "clusterID":
			p.ClusterID = v
		case k == "snapshotNamePrefix":
			if v == "" || len(v) > 64 || strings.ContainsAny(v, "/@ ") {
				return p, fmt.Errorf("parameter %q: want up to 64 characters, without '/', '@' or spaces", k)
			}
			p.Prefix = v
		case strings.HasPrefix(k, "csi.storage.k8s.io/"):
			// The snapshotter's secret keys and --extra-create-metadata.
		default:
			return p, fmt.Errorf("unknown parameter %q (known: clusterID, snapshotNamePrefix, csi.storage.k8s.io/*)", k)
		}
	}
	return p, nil
}

func (d *Driver) CreateSnapshot(ctx context.Context, req *csi.CreateSnapshotRequest) (*csi.CreateSnapshotResponse, error) {
	if err := validateCreateSnapshotRequest(req); err != nil {
		return nil, err
	}
	p, err := parseSnapParams(req.GetParameters())
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	src, o, err := d.volumeAccess(req.GetSourceVolumeId(), req.GetSecrets(), true)
	if err != nil {
		return nil, err
	}
	if p.ClusterID != "" && p.ClusterID != src.ClusterID {
		return nil, status.Errorf(codes.InvalidArgument, "parameter %q is %q, but the source volume is on cluster %q",
			"clusterID", p.ClusterID, src.ClusterID)
	}
	release, err := d.locks.acquire("snapshot/" + req.GetName())
	if err != nil {
		return nil, err
	}
	// librbd cannot be interrupted: a snapshot that outlasts the call
	// finishes anyway, and holds the name until then.
	return detach(ctx, release, func() (*csi.CreateSnapshotResponse, error) {
		snap, err := d.createSnapshot(o, src, req.GetName(), p)
		if err != nil {
			return nil, err
		}
		return &csi.CreateSnapshotResponse{Snapshot: snap}, nil
	})
}

func (d *Driver) createSnapshot(o ceph.Options, src volume, name string, p snapParams) (*csi.Snapshot, error) {
	j := d.journal(o, src.Spec.Pool, src.Spec.Namespace)
	var rec snapRecord
	found, err := j.get(snapKey(name), &rec)
	if err != nil {
		return nil, cephStatus(err, "read the snapshot journal")
	}
	if found && rec.Source != src.ID() {
		return nil, status.Errorf(codes.AlreadyExists, "snapshot %q exists, of volume %s", name, rec.Source)
	}
	if found && rec.ID != "" {
		// A retry of a snapshot taken: answered from the snapshot itself,
		// whatever became of the source volume since.
		if snap, err := d.takenSnapshot(o, j, name, rec); err == nil || status.Code(err) != codes.NotFound {
			return snap, err
		}
		// Removed behind our back: take it again.
	}
	info, err := d.cfg.Images.ImageInfo(o, src.Spec)
	if err != nil {
		if found && rec.ID == "" && errors.Is(err, ceph.ErrImageNotFound) {
			j.update(nil, snapKey(name)) // the reservation of a snapshot never taken
		}
		return nil, cephStatus(err, "look up source volume "+describe(src))
	}
	if !info.HasFeature("layering") {
		return nil, status.Errorf(codes.InvalidArgument,
			"source volume %s has no layering feature: no volume could be restored from a snapshot of it", describe(src))
	}
	if !found {
		rec = snapRecord{Source: src.ID(), Snap: hashName(p.Prefix, name), Kind: info.Meta[metaKind]}
		if err := j.update(map[string]any{snapKey(name): rec}); err != nil {
			return nil, cephStatus(err, "reserve snapshot name")
		}
	}
	snaps, err := d.cfg.Images.ListSnapshots(o, src.Spec)
	if err != nil {
		return nil, cephStatus(err, "list snapshots of "+describe(src))
	}
	if !hasSnapshot(snaps, rec.Snap) {
		if err := d.snapshotRoom(o, src, info, snaps); err != nil {
			return nil, err
		}
	}
	var s ceph.SnapshotOf
	ref := ceph.ImageRef{Pool: src.Spec.Pool, Namespace: src.Spec.Namespace, ID: info.ID}
	err = d.flat.quiet(src.ClusterID, ref, func() error {
		var err error
		s, err = d.cfg.Images.CreateSnapshot(o, src.Spec, rec.Snap, ceph.QuiesceRequired)
		return err
	})
	if err != nil {
		if strings.Contains(err.Error(), "could not quiesce") {
			return nil, status.Errorf(codes.Unavailable, "snapshot %q of %s: %v", name, describe(src), err)
		}
		return nil, cephStatus(err, "snapshot "+describe(src))
	}
	id := snapshotID{ClusterID: src.ClusterID, Image: s.Image, SnapID: s.ID}
	rec.ID, rec.Size, rec.Created = id.String(), usableBytes(s.Size, info.Meta), s.Created.UTC()
	if err := j.update(map[string]any{snapKey(name): rec, snapIDKey(id): name}); err != nil {
		return nil, cephStatus(err, "record snapshot")
	}
	ready, err := d.snapshotReady(o, id, s.ImageName, true)
	if err != nil {
		return nil, err
	}
	if err := j.markReady(name, &rec, ready); err != nil {
		return nil, cephStatus(err, "record snapshot")
	}
	d.log.Info("snapshot taken", "name", name, "snapshot", id.String(), "image", src.Spec.String(), "rbd_snap", rec.Snap,
		"ready", ready)
	return rec.csi(ready), nil
}

// takenSnapshot answers for a journalled snapshot that exists, and
// journals its readiness if that changed.
func (d *Driver) takenSnapshot(o ceph.Options, j journal, name string, rec snapRecord) (*csi.Snapshot, error) {
	sid, err := parseSnapshotID(rec.ID)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "journalled snapshot ID: %v", err)
	}
	s, err := d.cfg.Images.GetSnapshot(o, sid.Image, sid.SnapID)
	switch {
	case errors.Is(err, ceph.ErrSnapshotNotFound), errors.Is(err, ceph.ErrImageNotFound), err == nil && s.Trash:
		return nil, status.Errorf(codes.NotFound, "snapshot %s is gone", sid)
	case err != nil:
		return nil, cephStatus(err, "look up snapshot "+sid.String())
	}
	ready, err := d.snapshotReady(o, sid, s.ImageName, true)
	if err != nil {
		return nil, err
	}
	if err := j.markReady(name, &rec, ready); err != nil {
		return nil, cephStatus(err, "record snapshot")
	}
	return rec.csi(ready), nil
}

// snapshotRoom applies the snapshot-count limits before another snapshot
// of src's image: past the lower one it starts flattening the clones of
// its trashed snapshots, past the upper one it refuses.
func (d *Driver) snapshotRoom(o ceph.Options, src volume, info ceph.ImageInfo, snaps []ceph.Snapshot) error {
	trashed := 0
	for _, s := range snaps {
		if s.Trash {
			trashed++
		}
	}
	step := d.cfg.Limits.snapStep(len(snaps), trashed)
	if step.FlattenTrashed {
		d.flattenTrashed(o, src.ClusterID, ceph.ImageRef{Pool: src.Spec.Pool, Namespace: src.Spec.Namespace, ID: info.ID},
			src.Spec.String(), snaps)
	}
	if !step.Refuse {
		return nil
	}
	if step.Wait {
		return status.Errorf(codes.ResourceExhausted,
			"volume %s has %d snapshots (limit %d), %d of them deleted but kept for clones: flattening those clones; retry",
			describe(src), len(snaps), d.cfg.Limits.MaxSnapshots, trashed)
	}
	return status.Errorf(codes.ResourceExhausted, "volume %s has %d snapshots (limit %d): delete some first",
		describe(src), len(snaps), d.cfg.Limits.MaxSnapshots)
}

// snapshotReady says whether a volume can be restored from the
// snapshot now: its parent chain leaves room for one more link. If not,
// it starts flattening the snapshot's image, after which it can.
func (d *Driver) snapshotReady(o ceph.Options, id snapshotID, imageName string, mayFlatten bool) (bool, error) {
	chain, err := d.cfg.Images.ParentChain(o, id.Image, id.SnapID)
	if err != nil {
		return false, cephStatus(err, "parent chain of snapshot "+id.String())
	}
	info, err := d.cfg.Images.ImageInfo(o, ceph.ImageSpec{Pool: id.Image.Pool, Namespace: id.Image.Namespace, Image: imageName})
	if err != nil {
		return false, cephStatus(err, "look up the image of snapshot "+id.String())
	}
	// Without deep-flatten, flattening the image leaves the snapshot's
	// chain: a restore then flattens the new volume before handing it
	// out, and the snapshot is ready as it is.
	if d.cfg.Limits.cloneStep(len(chain), info.HasFeature("deep-flatten")) != flattenParentFirst {
		return true, nil
	}
	if !mayFlatten {
		return false, nil // read-only credentials: the next CreateSnapshot retry starts it
	}
	j := d.journal(o, id.Image.Pool, id.Image.Namespace)
	if _, err := d.flat.start(id.ClusterID, o, j, id.Image, imageName,
		fmt.Sprintf("its snapshot %d has %d parents: no restore would be within the hard depth", id.SnapID, len(chain)), nil); err != nil {
		return false, cephStatus(err, "start flatten")
	}
	return false, nil
}

func hasSnapshot(snaps []ceph.Snapshot, name string) bool {
	for _, s := range snaps {
		if s.Name == name && !s.Trash {
			return true
		}
	}
	return false
}

// csi is the record as a CSI snapshot.
func (r snapRecord) csi(ready bool) *csi.Snapshot {
	return &csi.Snapshot{SnapshotId: r.ID, SourceVolumeId: r.Source, SizeBytes: int64(r.Size),
		CreationTime: timestamppb.New(r.Created), ReadyToUse: ready}
}

// DeleteSnapshot removes the RBD snapshot (kept by librbd in the trash
// namespace while restores depend on it) and its journal entries, and
// the deleted volume's image it was on, if it was the last thing
// keeping it. Unknown IDs succeed, as the spec asks.
func (d *Driver) DeleteSnapshot(ctx context.Context, req *csi.DeleteSnapshotRequest) (*csi.DeleteSnapshotResponse, error) {
	if err := validateDeleteSnapshotRequest(req); err != nil {
		return nil, err
	}
	sid, err := parseSnapshotID(req.GetSnapshotId())
	if err != nil {
		d.log.Info("delete of a snapshot ID that is not ours", "id", req.GetSnapshotId())
		return &csi.DeleteSnapshotResponse{}, nil
	}
	o, err := d.clusterAccess(sid.ClusterID, req.GetSecrets(), true)
	if status.Code(err) == codes.NotFound {
		// Not "success": the snapshot may well exist on a cluster
		// missing from the config, and would be leaked forever.
		return nil, status.Error(codes.InvalidArgument, status.Convert(err).Message())
	}
	if err != nil {
		return nil, err
	}
	release, err := d.locks.acquire("snapshot-id/" + sid.String())
	if err != nil {
		return nil, err
	}
	defer release()
	j := d.journal(o, sid.Image.Pool, sid.Image.Namespace)
	name, named, err := j.getString(snapIDKey(sid))
	if err != nil {
		return nil, cephStatus(err, "read the snapshot journal")
	}
	// Already in the trash namespace (an earlier call removed it while
	// restores need it): deleted as far as CSI goes; librbd would answer
	// EBUSY to another remove.
	s, err := d.cfg.Images.GetSnapshot(o, sid.Image, sid.SnapID)
	if err == nil && !s.Trash {
		err = d.cfg.Images.RemoveSnapshot(o, sid.Image, sid.SnapID)
	}
	switch {
	case err == nil:
		d.log.Info("deleted snapshot", "snapshot", sid.String(), "name", name)
	case errors.Is(err, ceph.ErrSnapshotNotFound), errors.Is(err, ceph.ErrImageNotFound), errors.Is(err, ceph.ErrPoolNotFound):
	default:
		return nil, cephStatus(err, "delete snapshot "+sid.String())
	}
	rm := []string{snapIDKey(sid)}
	if named {
		var rec snapRecord
		if ok, err := j.get(snapKey(name), &rec); err == nil && ok && rec.ID == sid.String() {
			rm = append(rm, snapKey(name))
		}
	}
	if err := j.update(nil, rm...); err != nil {
		return nil, cephStatus(err, "update the snapshot journal")
	}
	d.collectGone(o, sid.ClusterID, sid.Image)
	return &csi.DeleteSnapshotResponse{}, nil
}

// GetSnapshot answers for one snapshot by ID; NotFound if it is gone.
func (d *Driver) GetSnapshot(ctx context.Context, req *csi.GetSnapshotRequest) (*csi.GetSnapshotResponse, error) {
	if err := validateGetSnapshotRequest(req); err != nil {
		return nil, err
	}
	sid, err := parseSnapshotID(req.GetSnapshotId())
	if err != nil {
		return nil, status.Error(codes.NotFound, err.Error())
	}
	snap, err := d.snapshotByID(sid, req.GetSecrets())
	if err != nil {
		return nil, err
	}
	return &csi.GetSnapshotResponse{Snapshot: snap}, nil
}

// snapshotByID looks a snapshot up on its image and in the journal,
// and works out whether it is ready now.
func (d *Driver) snapshotByID(sid snapshotID, secrets map[string]string) (*csi.Snapshot, error) {
	o, err := d.clusterAccess(sid.ClusterID, secrets, false)
	if err != nil {
		return nil, err
	}
	s, err := d.cfg.Images.GetSnapshot(o, sid.Image, sid.SnapID)
	switch {
	case errors.Is(err, ceph.ErrSnapshotNotFound), errors.Is(err, ceph.ErrImageNotFound), errors.Is(err, ceph.ErrPoolNotFound),
		err == nil && s.Trash:
		return nil, status.Errorf(codes.NotFound, "snapshot %s does not exist", sid)
	case err != nil:
		return nil, cephStatus(err, "look up snapshot "+sid.String())
	}
	j := d.journal(o, sid.Image.Pool, sid.Image.Namespace)
	name, ok, err := j.getString(snapIDKey(sid))
	if err != nil {
		return nil, cephStatus(err, "read the snapshot journal")
	}
	var rec snapRecord
	if ok {
		ok, err = j.get(snapKey(name), &rec)
		if err != nil {
			return nil, cephStatus(err, "read the snapshot journal")
		}
	}
	if !ok || rec.ID != sid.String() {
		return nil, status.Errorf(codes.NotFound, "snapshot %s is not a VolumeSnapshot of this driver", sid)
	}
	// Credentials remembered from another call serve reads only: they
	// may not start a flatten, nor rewrite the journal.
	write := d.writeCreds(secrets)
	ready, err := d.snapshotReady(o, sid, s.ImageName, write)
	if err != nil {
		return nil, err
	}
	if write {
		if err := j.markReady(name, &rec, ready); err != nil {
			d.log.Warn("record a snapshot's readiness", "snapshot", sid.String(), "err", err)
		}
	}
	return rec.csi(ready), nil
}

// ListSnapshots lists the journals' snapshots: of one ID, of one source
// volume, or of every pool of every configured cluster there are
// credentials for. Entries are sorted by snapshot ID; the token is the
// last ID returned, so deletions between pages skip nothing.
func (d *Driver) ListSnapshots(ctx context.Context, req *csi.ListSnapshotsRequest) (*csi.ListSnapshotsResponse, error) {
	if req.GetMaxEntries() < 0 {
		return nil, status.Error(codes.InvalidArgument, "max entries cannot be negative")
	}
	after := req.GetStartingToken()
	if after != "" {
		if _, err := parseSnapshotID(after); err != nil {
			return nil, status.Errorf(codes.Aborted, "bad starting token %q", after)
		}
	}
	var snaps []*csi.Snapshot
	switch {
	case req.GetSnapshotId() != "":
		sid, err := parseSnapshotID(req.GetSnapshotId())
		if err != nil {
			return &csi.ListSnapshotsResponse{}, nil
		}
		s, err := d.snapshotByID(sid, req.GetSecrets())
		if status.Code(err) == codes.NotFound {
			return &csi.ListSnapshotsResponse{}, nil
		}
		if err != nil {
			return nil, err
		}
		snaps = append(snaps, s)
	case req.GetSourceVolumeId() != "":
		src, o, err := d.volumeAccess(req.GetSourceVolumeId(), req.GetSecrets(), false)
		if status.Code(err) == codes.NotFound {
			return &csi.ListSnapshotsResponse{}, nil
		}
		if err != nil {
			return nil, err
		}
		all, err := d.journaledSnapshots(o, src.Spec.Pool, src.Spec.Namespace)
		if err != nil {
			return nil, err
		}
		for _, s := range all {
			if s.SourceVolumeId == src.ID() {
				snaps = append(snaps, s)
			}
		}
	default:
		var err error
		if snaps, err = d.allSnapshots(req.GetSecrets()); err != nil {
			return nil, err
		}
	}
	sort.Slice(snaps, func(i, k int) bool { return snaps[i].SnapshotId < snaps[k].SnapshotId })
	start := sort.Search(len(snaps), func(i int) bool { return after == "" || snaps[i].SnapshotId > after })
	end := pageEnd(start, len(snaps), req.GetMaxEntries())
	resp := &csi.ListSnapshotsResponse{}
	for _, s := range snaps[start:end] {
		resp.Entries = append(resp.Entries, &csi.ListSnapshotsResponse_Entry{Snapshot: s})
	}
	if end < len(snaps) {
		resp.NextToken = snaps[end-1].SnapshotId
	}
	return resp, nil
}

// journaledSnapshots are the snapshots a pool's journal records as
// taken. Readiness is the one recorded when the snapshot was taken or
// last looked up by ID (GetSnapshot, ListSnapshots by ID or a
// CreateSnapshot retry, which the snapshotter makes until it is ready).
func (d *Driver) journaledSnapshots(o ceph.Options, pool, namespace string) ([]*csi.Snapshot, error) {
	recs, err := list[snapRecord](d.journal(o, pool, namespace), jSnapshot)
	if err != nil {
		return nil, cephStatus(err, "read the snapshot journal of pool "+pool)
	}
	out := make([]*csi.Snapshot, 0, len(recs))
	for _, r := range recs {
		if r.ID != "" {
			out = append(out, r.csi(!r.NotReady))
		}
	}
	return out, nil
}

func (d *Driver) allSnapshots(secrets map[string]string) ([]*csi.Snapshot, error) {
	cs, err := d.clusters.load()
	if err != nil {
		return nil, status.Error(codes.FailedPrecondition, err.Error())
	}
	var out []*csi.Snapshot
	for _, cl := range cs {
		creds, err := credentialsFrom(secrets)
		if err != nil {
			var ok bool
			if creds, ok = d.knownCreds(cl.ClusterID); !ok {
				continue
			}
		}
		if len(cl.Monitors) == 0 {
			continue
		}
		o := cl.options(creds, controllerOSDTimeout)
		pools, err := d.cfg.Images.ListPools(o)
		if err != nil {
			return nil, cephStatus(err, "list pools of cluster "+cl.ClusterID)
		}
		for _, pool := range pools {
			snaps, err := d.journaledSnapshots(o, pool, cl.RBD.RadosNamespace)
			if err != nil {
				continue // not a pool we can read
			}
			out = append(out, snaps...)
		}
	}
	return out, nil
}
