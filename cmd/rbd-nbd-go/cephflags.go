package main

import (
	"time"

	"github.com/spf13/pflag"

	"github.com/rbd-nbd-go/rbd-nbd-go/rbdio"
)

// addCephFlags registers Ceph's own client option names. Secrets are only
// accepted as files (--keyring, --keyfile), never as values on argv.
func addCephFlags(f *pflag.FlagSet, o *rbdio.Options) {
	f.StringVarP(&o.Conf, "conf", "c", "", "ceph.conf path (default $CEPH_CONF, then Ceph's search path)")
	f.StringVarP(&o.MonHost, "mon-host", "m", "", "monitor addresses")
	f.StringVar(&o.ID, "id", "", "client name without \"client.\" (default admin)")
	f.StringVar(&o.Keyring, "keyring", "", "keyring file")
	f.StringVar(&o.Keyfile, "keyfile", "", "file holding the bare secret key")
	f.DurationVar(&o.OpTimeout, "op-timeout", 30*time.Second,
		"bound on each RADOS operation and on connecting (rados osd/mon op timeout)")
}
