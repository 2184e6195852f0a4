package daemon

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/rbdio"
)

// After a kill -9 the dead daemon's RADOS sessions keep their watches on
// the OSDs until osd_client_watch_timeout (30 s), and librbd will not
// break an exclusive lock whose owner still watches: the new daemon's
// reattach waited about 27 s for every locked image. So each daemon
// records its sessions' addresses in the state directory as it opens
// them; the next daemon, once sure the recorder is gone, blocklists
// them on its first session to the same cluster, before any image there
// takes a lock or writes (the opens read their headers meanwhile). The
// OSDs drop the watches at once and refuse whatever the dead process
// still had in flight, so no stale write can land after the new owner's.
//
// "Sure it is gone" is two proofs: we hold the state directory's flock,
// which the old daemon held until its last descriptor closed; and the
// recorded pid no longer runs with the recorded start time. A daemon
// that stopped cleanly (its images closed, its locks released) marks
// its record clean and is never fenced.

// fenceExpire is how long a fenced address stays blocklisted: Ceph's
// own default, ample for any write the dead process had in flight.
const fenceExpire = time.Hour

// fenceWindow drops predecessors' sessions that were not fenced within
// it (no device of that cluster came back): their watches have long
// timed out, and their in-flight writes long landed or failed.
const fenceWindow = time.Hour

type sessionRecord struct {
	FSID  string   `json:"fsid"`
	Addrs []string `json:"addrs"`
	// Since: when a predecessor's session was found dead.
	Since time.Time `json:"since,omitzero"`
}

// sessionsFile is the state directory's sessions.json.
type sessionsFile struct {
	PID      int             `json:"pid"`
	Start    uint64          `json:"start"` // /proc/PID/stat starttime
	Clean    bool            `json:"clean"`
	Sessions []sessionRecord `json:"sessions"` // ours, open
	Dead     []sessionRecord `json:"dead"`     // predecessors', not yet fenced
}

type fencer struct {
	path string
	log  *slog.Logger
	now  func() time.Time

	mu  sync.Mutex
	rec sessionsFile
}

// processProbe tells whether pid still runs with the given start time.
type processProbe func(pid int, start uint64) bool

// newFencer reads the predecessor's record from dir and starts ours.
// The caller holds dir's daemon lock.
func newFencer(dir string, self sessionsFile, alive processProbe, now func() time.Time, log *slog.Logger) (*fencer, error) {
	f := &fencer{path: filepath.Join(dir, "sessions.json"), log: log, now: now}
	var prev sessionsFile
	b, err := os.ReadFile(f.path)
	switch {
	case errors.Is(err, os.ErrNotExist):
	case err != nil:
		return nil, err
	default:
		if err := json.Unmarshal(b, &prev); err != nil {
			log.Warn("unreadable sessions record; not fencing", "path", f.path, "err", err)
			prev = sessionsFile{}
		}
	}
	t := now()
	dead := slices.DeleteFunc(prev.Dead, func(s sessionRecord) bool { return t.Sub(s.Since) > fenceWindow })
	switch {
	case prev.PID == 0 || prev.Clean || len(prev.Sessions) == 0:
	case alive(prev.PID, prev.Start):
		// Cannot happen while we hold the flock, short of a second
		// daemon on a copy of this directory: never fence a live one.
		log.Error("the previous daemon still runs: not fencing its sessions", "pid", prev.PID)
	default:
		for _, s := range prev.Sessions {
			s.Since = t
			dead = append(dead, s)
		}
		log.Info("the previous daemon did not stop cleanly: its sessions will be fenced",
			"pid", prev.PID, "sessions", len(prev.Sessions))
	}
	f.rec = sessionsFile{PID: self.PID, Start: self.Start, Dead: dead}
	return f, f.save()
}

// opened fences the dead sessions of fsid's cluster through the new
// session (blocklist), then records the new one.
func (f *fencer) opened(fsid string, addrs []string, blocklist func(addr string, expire time.Duration) error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var keep []sessionRecord
	for _, d := range f.rec.Dead {
		if d.FSID != fsid || fsid == "" {
			keep = append(keep, d)
			continue
		}
		for _, a := range d.Addrs {
			if slices.Contains(addrs, a) {
				continue // never our own
			}
			t0 := time.Now()
			if err := blocklist(a, fenceExpire); err != nil {
				// Not fatal: the lock is then broken once the watch
				// times out, as without fencing.
				f.log.Warn("cannot fence the previous daemon's session", "addr", a, "err", err)
				continue
			}
			f.log.Info("fenced the previous daemon's session", "addr", a, "expire", fenceExpire,
				"took", time.Since(t0).Round(time.Millisecond))
		}
	}
	f.rec.Dead = keep
	f.rec.Sessions = append(f.rec.Sessions, sessionRecord{FSID: fsid, Addrs: addrs})
	f.saveLogged()
}

// closed forgets a session shut down cleanly: its watches went with it.
func (f *fencer) closed(addrs []string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.rec.Sessions = slices.DeleteFunc(f.rec.Sessions, func(s sessionRecord) bool { return slices.Equal(s.Addrs, addrs) })
	f.saveLogged()
}

// clean marks the record: this daemon stopped with every image closed.
func (f *fencer) clean() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.rec.Clean = true
	return f.save()
}

// saveLogged saves the record, unless it is marked clean: that is final,
// and after a handover the new daemon writes its own to the same file
// while this one closes its images (their sessions' Closed hooks).
func (f *fencer) saveLogged() {
	if f.rec.Clean {
		return
	}
	if err := f.save(); err != nil {
		f.log.Warn("cannot record RADOS sessions; a kill -9 will be recovered slowly", "err", err)
	}
}

// save replaces the record atomically (a temporary file renamed), with
// no fsync: the record matters only while the machine is up, since its
// sessions die with it, and a daemon writes it in an upgrade's pause
// (a journal commit each time, were the state directory not on tmpfs).
func (f *fencer) save() error {
	b, err := json.MarshalIndent(f.rec, "", "  ")
	if err != nil {
		return err
	}
	tmp := f.path + ".tmp"
	t, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	_, err = t.Write(b)
	err = errors.Join(err, t.Close())
	if err != nil {
		return err
	}
	return os.Rename(tmp, f.path)
}

// selfProcess is this process's identity for the record.
func selfProcess() sessionsFile {
	pid := os.Getpid()
	start, _ := procStart(pid)
	return sessionsFile{PID: pid, Start: start}
}

// procAlive is the real processProbe: /proc/PID/stat with the same start
// time (a reused pid has another).
func procAlive(pid int, start uint64) bool {
	s, err := procStart(pid)
	return err == nil && s == start
}

// procStart reads field 22 of /proc/PID/stat, the start time in clock
// ticks since boot; fields are counted after the command name's ")",
// which may itself hold spaces or parentheses.
func procStart(pid int) (uint64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, fmt.Errorf("/proc/%d/stat: no command name", pid)
	}
	fields := strings.Fields(s[i+1:])
	if len(fields) < 20 {
		return 0, fmt.Errorf("/proc/%d/stat: short", pid)
	}
	return strconv.ParseUint(fields[19], 10, 64)
}

// earlySessions holds the RADOS sessions opened before this daemon owns
// the state directory (images opened ahead of a handover) until the
// fencer exists; then it passes them, and every later one, to it. The
// fencer decides only once the directory is ours: it may fence a dead
// predecessor's sessions through them, before any lock is asked for.
//
// Each session's fencing runs in the background (the fencer takes them
// one at a time), and the session's images open meanwhile: rbdio makes
// them wait for it (the channel the Opened hook returns) only before
// they take a lock or write. After a kill -9 the blocklist and the image
// opens overlap, instead of adding up.
type earlySessions struct {
	mu       sync.Mutex
	f        *fencer
	sessions []*earlySession // open, pending or handed to f
}

type earlySession struct {
	fsid      string
	addrs     []string
	blocklist func(addr string, expire time.Duration) error
	started   bool          // handed to the fencer
	fenced    chan struct{} // closed once the fencer has had it
}

func (e *earlySessions) hooks() rbdio.SessionHooks {
	return rbdio.SessionHooks{
		Opened: func(s rbdio.Session) <-chan struct{} { return e.opened(s.FSID, s.Addrs, s.Blocklist) },
		Closed: func(s rbdio.Session) { e.closed(s.Addrs) },
	}
}

// opened takes a new session: fenced at once if the fencer exists, else
// once it does. The channel closes when that is done.
func (e *earlySessions) opened(fsid string, addrs []string, blocklist func(addr string, expire time.Duration) error) <-chan struct{} {
	s := &earlySession{fsid: fsid, addrs: addrs, blocklist: blocklist, fenced: make(chan struct{})}
	e.mu.Lock()
	defer e.mu.Unlock()
	e.sessions = append(e.sessions, s)
	if e.f != nil {
		e.start(s)
	}
	return s.fenced
}

// start hands s to the fencer, in the background. Under e.mu.
func (e *earlySessions) start(s *earlySession) {
	s.started = true
	f := e.f
	go func() {
		f.opened(s.fsid, s.addrs, s.blocklist)
		close(s.fenced)
	}()
}

// closed forgets a session shut down cleanly, after its fencing (its
// record then goes, not the other way round).
func (e *earlySessions) closed(addrs []string) {
	e.mu.Lock()
	var s *earlySession
	// A session without addresses (rados_getaddrs failed) cannot be told
	// from another such: it stays listed, and its fencing is not cut short.
	if i := slices.IndexFunc(e.sessions, func(s *earlySession) bool {
		return len(addrs) > 0 && slices.Equal(s.addrs, addrs)
	}); i >= 0 {
		s = e.sessions[i]
		e.sessions = slices.Delete(e.sessions, i, i+1)
	}
	f := e.f
	e.mu.Unlock()
	switch {
	case s != nil && !s.started:
		close(s.fenced) // never the fencer's: nothing recorded
		return
	case s != nil:
		<-s.fenced
	}
	if f != nil {
		f.closed(addrs)
	}
}

// attach hands the pending sessions, and every later one, to f.
func (e *earlySessions) attach(f *fencer) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.f = f
	for _, s := range e.sessions {
		if !s.started {
			e.start(s)
		}
	}
}
