package rbdio

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/ceph/go-ceph/rados"
)

// Session is one RADOS client session: which cluster, and the address
// the OSDs know it by. After a kill -9 its watches stay registered on
// the OSDs until osd_client_watch_timeout (30 s), and librbd will not
// break an exclusive lock whose owner still watches; blocklisting the
// address drops the watches at once and makes the OSDs refuse anything
// the dead client still had in flight.
type Session struct {
	FSID string
	// Addrs are the session's entity addresses ("ip:port/nonce"); the
	// nonce makes them unique to this process's session.
	Addrs []string
	conn  *rados.Conn
}

func sessionOf(conn *rados.Conn) Session {
	s := Session{conn: conn}
	s.FSID, _ = conn.GetFSID()
	if a, err := conn.GetAddrs(); err == nil {
		s.Addrs = ParseAddrs(a)
	}
	return s
}

// ParseAddrs splits what rados_getaddrs gives ("ip:port/nonce", or an
// address vector "[v2:ip:port/nonce,v1:ip:port/nonce]") into the plain
// addresses "osd blocklist add" takes, without duplicates.
func ParseAddrs(s string) []string {
	s = strings.TrimSuffix(strings.TrimPrefix(strings.TrimSpace(s), "["), "]")
	var out []string
	for _, a := range strings.Split(s, ",") {
		a = strings.TrimSpace(a)
		for _, p := range []string{"v1:", "v2:", "any:"} {
			a = strings.TrimPrefix(a, p)
		}
		if strings.Contains(a, "/") && !slices.Contains(out, a) {
			out = append(out, a)
		}
	}
	return out
}

// Blocklist fences addr on the session's cluster for expire. go-ceph's
// admin helper takes only a bare IP or a CIDR, which would fence every
// client of the node, this daemon's new session included; the mon
// command takes one session's address.
func (s Session) Blocklist(addr string, expire time.Duration) error {
	if s.conn == nil {
		return fmt.Errorf("blocklist %s: no session", addr)
	}
	cmd, err := json.Marshal(map[string]any{"prefix": "osd blocklist", "blocklistop": "add",
		"addr": addr, "expire": json.Number(fmt.Sprintf("%.1f", expire.Seconds()))})
	if err != nil {
		return err
	}
	if _, st, err := s.conn.MonCommand(cmd); err != nil {
		return fmt.Errorf("blocklist %s: %s: %w", addr, strings.TrimSpace(st), err)
	}
	return nil
}
