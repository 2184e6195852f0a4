package ceph

import (
	"fmt"
	"log/slog"
	"time"
)

// Options are the usual Ceph client inputs, named as Ceph names them.
// On the command line keys are only taken by file (keyring, keyfile),
// never as values, so they cannot leak into argv. Key carries a secret
// already read from a keyfile (the node daemon gets it over its 0600
// control socket, because callers such as ceph-csi delete the keyfile
// right after the map); String and LogValue never show it.
//
// Options is comparable: rbdio shares one RADOS connection per distinct
// value.
type Options struct {
	Conf    string `json:"conf,omitempty"`     // -c/--conf; default $CEPH_CONF, then Ceph's own search
	MonHost string `json:"mon_host,omitempty"` // -m/--mon-host
	ID      string `json:"id,omitempty"`       // --id: client name without "client.", default "admin"
	Keyring string `json:"keyring,omitempty"`  // --keyring
	Keyfile string `json:"keyfile,omitempty"`  // --keyfile: a file holding the bare secret
	Key     string `json:"key,omitempty"`      // the bare secret itself
	// OpTimeout bounds connecting and monitor operations (rados mon op
	// timeout, client mount timeout); 0 means 30s, so a wrong address or
	// a dead cluster is reported instead of hanging.
	OpTimeout time.Duration `json:"op_timeout,omitempty"`
	// OSDOpTimeout bounds each OSD operation (rados osd op timeout),
	// which is every data-path I/O. 0, the default, waits as krbd does:
	// a block device should ride out an OSD outage rather than fail I/O
	// (the kernel's own --io-timeout decides), and an armed timer per op
	// costs CPU on every request.
	OSDOpTimeout time.Duration `json:"osd_op_timeout,omitempty"`
}

// String describes the identity without the secret.
func (o Options) String() string {
	key := ""
	if o.Key != "" {
		key = " key=<redacted>"
	}
	return fmt.Sprintf("client.%s mon_host=%q conf=%q keyring=%q keyfile=%q%s",
		o.User(), o.MonHost, o.Conf, o.Keyring, o.Keyfile, key)
}

// LogValue keeps the secret out of structured logs.
func (o Options) LogValue() slog.Value { return slog.StringValue(o.String()) }

// User is the client name without "client.", "admin" when unset.
func (o Options) User() string {
	if o.ID == "" {
		return "admin"
	}
	return o.ID
}

// Timeout is OpTimeout with its default applied.
func (o Options) Timeout() time.Duration {
	if o.OpTimeout <= 0 {
		return 30 * time.Second
	}
	return o.OpTimeout
}
