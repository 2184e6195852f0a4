package csi

import (
	"errors"
	"log/slog"
	"sync"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
)

// flattener runs the controller's flattens in the background, one per
// image at a time: a retried CreateVolume that finds its parent's
// flatten running waits for that one instead of starting another (what
// ceph-csi's retry storms lacked, ceph-csi #2469). Each flatten is
// recorded in the pool's journal before it starts and forgotten when it
// ends, so a controller that dies mid-way finds it at start and runs it
// again; librbd carries on from the objects already copied.
type flattener struct {
	images   Images
	log      *slog.Logger
	interval time.Duration // progress log period
	slots    chan struct{} // bounds flattens running at once

	mu   sync.Mutex
	jobs map[string]*flattenJob
	// locks serialise a flatten and a snapshot of the same image (see
	// exclusive).
	locks map[string]*imageLock
}

// imageLock is one image's flatten-or-snapshot lock, with its users.
type imageLock struct {
	mu    sync.Mutex
	users int
}

// flattenJob is one running flatten.
type flattenJob struct {
	ref         ceph.ImageRef
	name        string
	stop, done  chan struct{}
	mu          sync.Mutex
	doneObjects uint64
	totalObj    uint64
}

// progress is the objects copied and the total, as last reported.
func (j *flattenJob) progress() (uint64, uint64) {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.doneObjects, j.totalObj
}

func newFlattener(images Images, log *slog.Logger, parallel int, interval time.Duration) *flattener {
	return &flattener{images: images, log: log, interval: interval, slots: make(chan struct{}, parallel),
		jobs: map[string]*flattenJob{}, locks: map[string]*imageLock{}}
}

func jobKey(cluster string, ref ceph.ImageRef) string {
	return cluster + "/" + ref.Pool + "/" + ref.Namespace + "/" + ref.ID
}

// running returns the job flattening ref's image, if any.
func (f *flattener) running(cluster string, ref ceph.ImageRef) *flattenJob {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.jobs[jobKey(cluster, ref)]
}

// start flattens ref's image (named name, for the logs) unless a flatten
// of it already runs; either way it returns the job. The flatten is in
// the journal before start returns, so a controller restart cannot
// lose it. onDone runs after a successful flatten.
func (f *flattener) start(cluster string, o ceph.Options, j journal, ref ceph.ImageRef, name, reason string,
	onDone func()) (*flattenJob, error) {
	key := jobKey(cluster, ref)
	f.mu.Lock()
	if job := f.jobs[key]; job != nil {
		f.mu.Unlock()
		return job, nil
	}
	job := &flattenJob{ref: ref, name: name, stop: make(chan struct{}), done: make(chan struct{})}
	f.jobs[key] = job
	f.mu.Unlock()
	// An entry already there is a flatten that did not finish: a
	// controller died, or it failed. librbd must not trust the image's
	// object map then (rbdio.Clusters.Flatten says why).
	resumed, err := j.get(flattenKey(ref), nil)
	if err == nil && !resumed {
		rec := flattenRecord{Image: name, Reason: reason, Since: time.Now().UTC()}
		err = j.update(map[string]any{flattenKey(ref): rec})
	}
	if err != nil {
		f.mu.Lock()
		delete(f.jobs, key)
		f.mu.Unlock()
		close(job.done)
		return nil, err
	}
	go f.run(key, o, j, job, reason, resumed, onDone)
	return job, nil
}

func (f *flattener) run(key string, o ceph.Options, j journal, job *flattenJob, reason string, resumed bool, onDone func()) {
	log := f.log.With("image", job.name, "id", job.ref.String())
	defer func() {
		f.mu.Lock()
		delete(f.jobs, key)
		f.mu.Unlock()
		close(job.done)
	}()
	select {
	case f.slots <- struct{}{}:
	case <-job.stop:
		return // stopped before it started: still owed
	}
	defer func() { <-f.slots }()
	defer f.exclusive(key)()
	log.Info("flatten started", "reason", reason, "resumed", resumed)
	t0 := time.Now()
	err := f.images.Flatten(o, job.ref, resumed, job.stop, f.interval, func(done, total uint64) {
		job.mu.Lock()
		job.doneObjects, job.totalObj = done, total
		job.mu.Unlock()
		if total > 0 {
			log.Info("flatten progress", "objects", done, "of", total, "percent", done*100/total)
		}
	})
	switch {
	case err == nil:
		log.Info("flatten done", "took", time.Since(t0).Round(time.Millisecond))
	case errors.Is(err, ceph.ErrImageNotFound):
		log.Info("flatten: the image is gone")
	case errors.Is(err, ceph.ErrLocked):
		log.Info("flatten waits: an interrupted flatten resumes only while no node has the image mapped", "err", err)
		return
	default:
		select {
		case <-job.stop:
			log.Info("flatten stopped; it stays owed", "err", err)
		default:
			log.Error("flatten failed; the sweep retries it", "err", err)
		}
		return
	}
	if err := j.update(nil, flattenKey(job.ref)); err != nil {
		log.Warn("flatten: cannot clear its journal entry", "err", err)
	}
	if err == nil && onDone != nil {
		onDone()
	}
}

// exclusive takes the image's flatten-or-snapshot lock (key: jobKey)
// and returns its release. A snapshot must not be taken while the
// image is being flattened: librbd's flatten copies objects up under
// the snapshot context it started with, so an object copied up while a
// new snapshot is taken is missing from that snapshot, and once
// deep-flatten cuts the snapshot loose from its parent the object reads
// as zeros (seen on Ceph 16.2.15: 1 of 64 objects of a restore from such
// a snapshot). Writes are held back by librbd around a snapshot; a
// flatten's copy-ups are not.
func (f *flattener) exclusive(key string) func() {
	f.mu.Lock()
	l := f.locks[key]
	if l == nil {
		l = &imageLock{}
		f.locks[key] = l
	}
	l.users++
	f.mu.Unlock()
	l.mu.Lock()
	return func() {
		l.mu.Unlock()
		f.mu.Lock()
		if l.users--; l.users == 0 {
			delete(f.locks, key)
		}
		f.mu.Unlock()
	}
}

// quiet runs fn, a snapshot of ref's image, with no flatten of the image
// running in this controller: it waits for one that runs.
func (f *flattener) quiet(cluster string, ref ceph.ImageRef, fn func() error) error {
	key := jobKey(cluster, ref)
	if job := f.running(cluster, ref); job != nil {
		f.log.Info("snapshot waits for the image's flatten to end", "image", job.name)
	}
	defer f.exclusive(key)()
	return fn()
}

// cancel stops the flatten of ref's image, if one runs, and waits for
// it: the image is about to be removed, and the flatten's open handle
// would keep it.
func (f *flattener) cancel(cluster string, ref ceph.ImageRef) {
	job := f.running(cluster, ref)
	if job == nil {
		return
	}
	select {
	case <-job.stop:
	default:
		close(job.stop)
	}
	<-job.done
}

// stopAll stops every flatten (the controller is shutting down); each
// stays in the journal and is resumed by the next controller. It waits
// at most grace: a flatten the lock owner (a node) runs for us may not
// hear the stop.
func (f *flattener) stopAll(grace time.Duration) {
	f.mu.Lock()
	jobs := make([]*flattenJob, 0, len(f.jobs))
	for _, j := range f.jobs {
		jobs = append(jobs, j)
	}
	f.mu.Unlock()
	deadline := time.After(grace)
	for _, j := range jobs {
		select {
		case <-j.stop:
		default:
			close(j.stop)
		}
	}
	for _, j := range jobs {
		select {
		case <-j.done:
		case <-deadline:
			f.log.Warn("flattens still running at shutdown; they stay owed")
			return
		}
	}
}
