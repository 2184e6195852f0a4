package rbdio

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/ceph/go-ceph/rados"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
)

// Clusters shares one RADOS connection per cluster identity among every
// image the process opens: one set of monitor sessions and messenger
// threads per cluster, not per image as Ceph's rbd-nbd has it.
//
// A connect takes up to the monitor timeout (30 s when a monitor is
// down or a key is wrong) and is made without the lock: callers for
// the same identity wait for it, callers for any other identity (the
// right key, another cluster) do not. Holding the lock across it let
// one StorageClass's wrong key, retried by the provisioner, stall every
// CreateVolume and map behind it.
type Clusters struct {
	mu    sync.Mutex
	conns map[ceph.Options]*clusterRef
	hooks SessionHooks
	// linger keeps a connection nobody holds open this long, for the
	// next call to reuse (0: shut down at once), if it is younger than
	// maxAge. See NewClustersLinger.
	linger, maxAge time.Duration
}

// SessionHooks are told of each RADOS session: Opened right after the
// connect, before any image opens on it (so the node daemon can record
// the session's address, and fence a dead predecessor's, before it asks
// for any lock); Closed after a clean shutdown. Either may be nil.
//
// Opened may return a channel that closes once the session may write
// (its fencing done). An image's open reads its header meanwhile, and
// waits for it before it takes a lock or returns (a Deferred open: in
// Activate); every other call on the session waits for it first. After
// a kill -9 the blocklist and the opens then overlap, instead of adding
// up while every device waits.
type SessionHooks struct {
	Opened func(Session) <-chan struct{}
	Closed func(Session)
}

type clusterRef struct {
	ready chan struct{} // closed once the connect ended (conn or err set)
	conn  *rados.Conn
	err   error
	// fenced: from the Opened hook (nil: nothing to wait for)
	fenced <-chan struct{}
	refs   int // callers holding conn, and (before ready) waiting for it
	// images counts the images open on conn (Open to Close): a gauge of
	// the node daemon's metrics.
	images int
	// idle runs out the linger of a connection nobody holds (nil while
	// held); a caller that takes it back first stops it. idleGen tells
	// an expiry from an earlier release, whose Stop came too late.
	idle    *time.Timer
	idleGen uint64
	born    time.Time // when the connect began
}

// Connection is one shared cluster connection, named without its secret.
type Connection struct {
	// Cluster is where it connects: the monitors given, else the
	// ceph.conf it read.
	Cluster, User string
	Images        int
}

// Connections lists the open cluster connections and the images open
// on each.
func (c *Clusters) Connections() []Connection {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]Connection, 0, len(c.conns))
	for o, ref := range c.conns {
		cl := o.MonHost
		if cl == "" {
			cl = o.Conf
		}
		user := o.ID
		if user == "" {
			user = "admin"
		}
		out = append(out, Connection{Cluster: cl, User: user, Images: ref.images})
	}
	return out
}

// imageIOCtx is ioctx for an image being opened: the connection counts
// it from here until the release (which runs once, whichever path
// calls it). It does not wait for the session's fencing (SessionHooks)
// but returns it: the image may read before it closes, not write nor
// take a lock.
func (c *Clusters) imageIOCtx(o ceph.Options, spec ceph.ImageSpec) (*rados.IOContext, <-chan struct{}, func(), error) {
	ioctx, fenced, release, err := c.ioctxOn(o, spec, false)
	if err != nil {
		return nil, nil, nil, err
	}
	c.imageOpened(o, 1)
	var once sync.Once
	return ioctx, fenced, func() { once.Do(func() { c.imageOpened(o, -1); release() }) }, nil
}

// imageOpened counts an image in or out of the connection o names.
func (c *Clusters) imageOpened(o ceph.Options, delta int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if ref := c.conns[c.norm(o)]; ref != nil {
		ref.images += delta
	}
}

// norm is o as the connections are keyed: the conf from the environment
// if o names none.
func (c *Clusters) norm(o ceph.Options) ceph.Options {
	if o.Conf == "" {
		o.Conf = os.Getenv("CEPH_CONF")
	}
	return o
}

func NewClusters() *Clusters { return NewClustersWith(SessionHooks{}) }

// NewClustersLinger is NewClusters keeping each connection for linger
// after its last user let go. A connect is a monitor handshake, cephx
// and a messenger's threads: 20-40 ms on a quiet host, against
// microseconds for a call on a kept connection (TestLinger...), and
// tens of times that in a loaded TCG VM. The CSI controller's calls
// rarely overlap, so without a linger it connects once a call. The node
// daemon does not linger: its connections live as long as its images,
// and each is a session its successor must fence.
//
// A kept session is not made again: a blocklist of it, or caps changed
// on its key, last as long as it does. So a connection older than maxAge
// shuts down at its next release instead of lingering, even when calls
// keep coming (the controller's sweep runs every minute).
func NewClustersLinger(linger, maxAge time.Duration) *Clusters {
	c := NewClusters()
	c.linger, c.maxAge = linger, maxAge
	return c
}

// NewClustersWith is NewClusters with hooks on each session.
func NewClustersWith(h SessionHooks) *Clusters {
	return &Clusters{conns: map[ceph.Options]*clusterRef{}, hooks: h}
}

// get returns a connected handle for o, its fencing done, and a
// release function.
func (c *Clusters) get(o ceph.Options) (*rados.Conn, func(), error) {
	conn, fenced, release, err := c.session(o)
	if err != nil {
		return nil, nil, err
	}
	if fenced != nil {
		<-fenced
	}
	return conn, release, nil
}

// session is get without the wait for its fencing, which it returns.
func (c *Clusters) session(o ceph.Options) (*rados.Conn, <-chan struct{}, func(), error) {
	o = c.norm(o)
	c.mu.Lock()
	ref, ok := c.conns[o]
	if ok {
		ref.refs++
		if ref.idle != nil {
			ref.idle.Stop()
			ref.idle = nil
		}
		c.mu.Unlock()
		<-ref.ready
		if ref.err != nil {
			c.drop(o, ref)
			return nil, nil, nil, ref.err
		}
		return ref.conn, ref.fenced, c.releaser(o, ref), nil
	}
	ref = &clusterRef{ready: make(chan struct{}), refs: 1, born: time.Now()}
	c.conns[o] = ref
	c.mu.Unlock()
	ref.conn, ref.err = connect(o)
	if ref.err != nil {
		// Forget it at once: the next call tries again.
		c.mu.Lock()
		if c.conns[o] == ref {
			delete(c.conns, o)
		}
		ref.refs--
		c.mu.Unlock()
		close(ref.ready)
		return nil, nil, nil, ref.err
	}
	if c.hooks.Opened != nil {
		ref.fenced = c.hooks.Opened(sessionOf(ref.conn))
	}
	if ref.fenced != nil {
		// The fencing uses the connection: it keeps a reference of its
		// own until it ends, so that no last release shuts the
		// connection down under it (an open that failed meanwhile).
		c.mu.Lock()
		ref.refs++
		c.mu.Unlock()
		go func(fenced <-chan struct{}, release func()) { <-fenced; release() }(ref.fenced, c.releaser(o, ref))
	}
	close(ref.ready)
	return ref.conn, ref.fenced, c.releaser(o, ref), nil
}

// drop is a waiter's release of a connect that failed.
func (c *Clusters) drop(o ceph.Options, ref *clusterRef) {
	c.mu.Lock()
	ref.refs--
	c.mu.Unlock()
}

// ioctx opens spec's pool (and namespace) on the shared connection; the
// release function destroys the ioctx and drops the connection reference.
func (c *Clusters) ioctx(o ceph.Options, spec ceph.ImageSpec) (*rados.IOContext, func(), error) {
	ioctx, _, release, err := c.ioctxOn(o, spec, true)
	return ioctx, release, err
}

// ioctxOn is ioctx, waiting for the session's fencing or (wait false)
// returning it.
func (c *Clusters) ioctxOn(o ceph.Options, spec ceph.ImageSpec, wait bool) (*rados.IOContext, <-chan struct{}, func(), error) {
	conn, fenced, release, err := c.session(o)
	if err != nil {
		return nil, nil, nil, err
	}
	if wait && fenced != nil {
		<-fenced
		fenced = nil
	}
	ioctx, err := conn.OpenIOContext(spec.Pool)
	if err != nil {
		release()
		if cephErrno(err) == syscall.ENOENT {
			return nil, nil, nil, matching{fmt.Errorf("pool %q does not exist", spec.Pool), ceph.ErrPoolNotFound}
		}
		return nil, nil, nil, fmt.Errorf("pool %q: %w", spec.Pool, err)
	}
	ioctx.SetNamespace(spec.Namespace)
	return ioctx, fenced, func() { ioctx.Destroy(); release() }, nil
}

func (c *Clusters) releaser(o ceph.Options, ref *clusterRef) func() {
	var once sync.Once
	return func() {
		once.Do(func() {
			c.mu.Lock()
			ref.refs--
			last := ref.refs == 0
			if last && c.linger > 0 && c.conns[o] == ref && time.Since(ref.born) < c.maxAge {
				ref.idleGen++
				gen := ref.idleGen
				ref.idle = time.AfterFunc(c.linger, func() { c.expire(o, ref, gen) })
				c.mu.Unlock()
				return
			}
			if last && c.conns[o] == ref {
				delete(c.conns, o)
			}
			c.mu.Unlock()
			if last {
				c.shutdown(ref)
			}
		})
	}
}

// expire shuts down a lingering connection once the timer of its
// release gen ran out, unless a caller took it back meanwhile.
func (c *Clusters) expire(o ceph.Options, ref *clusterRef, gen uint64) {
	c.mu.Lock()
	if ref.idle == nil || ref.idleGen != gen || ref.refs != 0 {
		c.mu.Unlock()
		return
	}
	ref.idle = nil
	if c.conns[o] == ref {
		delete(c.conns, o)
	}
	c.mu.Unlock()
	c.shutdown(ref)
}

// shutdown ends a connection nobody holds, telling the Closed hook.
func (c *Clusters) shutdown(ref *clusterRef) {
	var s Session
	if c.hooks.Closed != nil {
		s = sessionOf(ref.conn)
	}
	ref.conn.Shutdown()
	if c.hooks.Closed != nil {
		c.hooks.Closed(s)
	}
}

func connect(o ceph.Options) (*rados.Conn, error) {
	conn, err := rados.NewConnWithUser(o.User())
	if err != nil {
		return nil, fmt.Errorf("ceph client: %w", err)
	}
	fail := func(err error) (*rados.Conn, error) {
		conn.Shutdown()
		return nil, err
	}
	if o.Conf != "" {
		if err := conn.ReadConfigFile(o.Conf); err != nil {
			return fail(fmt.Errorf("ceph config %s: %w", o.Conf, err))
		}
	} else if err := conn.ReadDefaultConfigFile(); err != nil && o.MonHost == "" {
		return fail(fmt.Errorf("no ceph config found (give -c or -m): %w", err))
	}
	secs := strconv.Itoa(int(o.Timeout().Seconds()))
	set := []struct{ k, v string }{
		{"rados_osd_op_timeout", strconv.Itoa(int(o.OSDOpTimeout.Seconds()))},
		{"rados_mon_op_timeout", secs},
		{"client_mount_timeout", secs},
		// Acknowledged writes must not live only in this process: a
		// kill -9 then reattach would lose them (seen with rbd-nbd).
		// The kernel's page cache already sits above the device.
		{"rbd_cache", "false"},
		// librbd may keep a reference to our (pinned) buffer instead of
		// copying it: we hold it until the write completes anyway.
		{"rbd_disable_zero_copy_writes", "false"},
	}
	if o.MonHost != "" {
		set = append(set, struct{ k, v string }{"mon_host", o.MonHost})
	}
	if o.Keyring != "" {
		set = append(set, struct{ k, v string }{"keyring", o.Keyring})
	}
	if o.Keyfile != "" && o.Key == "" {
		set = append(set, struct{ k, v string }{"keyfile", o.Keyfile})
	}
	if o.Key != "" {
		set = append(set, struct{ k, v string }{"key", o.Key})
	}
	for _, s := range set {
		if err := conn.SetConfigOption(s.k, s.v); err != nil {
			return fail(fmt.Errorf("ceph option %s: %w", s.k, err))
		}
	}
	if err := conn.Connect(); err != nil {
		return fail(describeConnectError(o, err))
	}
	return conn, nil
}

// describeConnectError says what most likely went wrong, in one line,
// without echoing any secret.
func describeConnectError(o ceph.Options, err error) error {
	who := "client." + o.User()
	if code := cephErrno(err); code != 0 {
		switch code {
		case syscall.EACCES, syscall.EPERM:
			return matching{fmt.Errorf("connect to ceph as %s: permission denied (wrong key or keyring?)", who), ceph.ErrPermission}
		case syscall.ETIMEDOUT:
			return matching{fmt.Errorf("connect to ceph as %s: no monitor answered within %s", who, o.Timeout()), ceph.ErrUnreachable}
		case syscall.ENOENT:
			return matching{fmt.Errorf("connect to ceph as %s: no key found for this user (give --keyring or --keyfile)", who), ceph.ErrPermission}
		case syscall.EINVAL:
			return matching{fmt.Errorf("connect to ceph as %s: invalid argument (malformed key, or a bad ceph option)", who), ceph.ErrPermission}
		}
	}
	return fmt.Errorf("connect to ceph as %s: %w", who, err)
}

// cephErrno extracts the errno from a go-ceph error, or our own cgo
// calls' (0 if none).
func cephErrno(err error) syscall.Errno {
	var en syscall.Errno
	if errors.As(err, &en) {
		return en
	}
	var ce interface{ ErrorCode() int }
	if errors.As(err, &ce) {
		if c := ce.ErrorCode(); c < 0 {
			return syscall.Errno(-c)
		}
	}
	return 0
}
