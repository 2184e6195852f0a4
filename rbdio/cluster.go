package rbdio

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"
	"syscall"

	"github.com/ceph/go-ceph/rados"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
)

// Clusters shares one RADOS connection per cluster identity among every
// image the process opens: one set of monitor sessions and messenger
// threads per cluster, not per image as Ceph's rbd-nbd has it.
type Clusters struct {
	mu    sync.Mutex
	conns map[ceph.Options]*clusterRef
}

type clusterRef struct {
	conn *rados.Conn
	refs int
}

func NewClusters() *Clusters { return &Clusters{conns: map[ceph.Options]*clusterRef{}} }

// get returns a connected handle for o and a release function.
func (c *Clusters) get(o ceph.Options) (*rados.Conn, func(), error) {
	if o.Conf == "" {
		o.Conf = os.Getenv("CEPH_CONF")
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if ref, ok := c.conns[o]; ok {
		ref.refs++
		return ref.conn, c.releaser(o, ref), nil
	}
	conn, err := connect(o)
	if err != nil {
		return nil, nil, err
	}
	ref := &clusterRef{conn: conn, refs: 1}
	c.conns[o] = ref
	return conn, c.releaser(o, ref), nil
}

// ioctx opens spec's pool (and namespace) on the shared connection; the
// release function destroys the ioctx and drops the connection reference.
func (c *Clusters) ioctx(o ceph.Options, spec ceph.ImageSpec) (*rados.IOContext, func(), error) {
	conn, release, err := c.get(o)
	if err != nil {
		return nil, nil, err
	}
	ioctx, err := conn.OpenIOContext(spec.Pool)
	if err != nil {
		release()
		if cephErrno(err) == syscall.ENOENT {
			return nil, nil, matching{fmt.Errorf("pool %q does not exist", spec.Pool), ceph.ErrPoolNotFound}
		}
		return nil, nil, fmt.Errorf("pool %q: %w", spec.Pool, err)
	}
	ioctx.SetNamespace(spec.Namespace)
	return ioctx, func() { ioctx.Destroy(); release() }, nil
}

func (c *Clusters) releaser(o ceph.Options, ref *clusterRef) func() {
	var once sync.Once
	return func() {
		once.Do(func() {
			c.mu.Lock()
			defer c.mu.Unlock()
			if ref.refs--; ref.refs == 0 {
				delete(c.conns, o)
				ref.conn.Shutdown()
			}
		})
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

// cephErrno extracts the errno from a go-ceph error (0 if none).
func cephErrno(err error) syscall.Errno {
	var ce interface{ ErrorCode() int }
	if errors.As(err, &ce) {
		if c := ce.ErrorCode(); c < 0 {
			return syscall.Errno(-c)
		}
	}
	return 0
}
