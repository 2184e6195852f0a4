package main

import (
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/spf13/pflag"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
)

// globalOpts are flags every subcommand takes, wherever they appear on the
// line: Ceph's client options (ceph-csi puts them before the subcommand),
// the log file and the node state directory.
type globalOpts struct {
	ceph     ceph.Options
	logFile  string
	logLevel string
	stateDir string
}

// addGlobalFlags registers Ceph's own client option names. Secrets are
// only accepted as files (--keyring, --keyfile), never as values on argv.
func addGlobalFlags(f *pflag.FlagSet, g *globalOpts) {
	o := &g.ceph
	f.StringVarP(&o.Conf, "conf", "c", "", "ceph.conf path (default $CEPH_CONF, then Ceph's search path)")
	f.StringVarP(&o.MonHost, "mon-host", "m", "", "monitor addresses")
	f.StringVar(&o.ID, "id", "", "client name without \"client.\" (default admin)")
	f.StringVar(&o.Keyring, "keyring", "", "keyring file")
	f.StringVar(&o.Keyfile, "keyfile", "", "file holding the bare secret key")
	f.DurationVar(&o.OpTimeout, "op-timeout", 30*time.Second,
		"bound on connecting and on monitor operations (rados mon op timeout)")
	f.DurationVar(&o.OSDOpTimeout, "osd-op-timeout", 0,
		"bound on each OSD operation, i.e. every I/O (rados osd op timeout); 0 waits, as krbd does")
	f.StringVar(&g.logFile, "log-file", "", "append this command's outcome here (the node daemon logs to STATE_DIR/daemon.log)")
	f.StringVar(&g.logLevel, "log-level", "info", "log level: debug, info, warn, error")
	def := os.Getenv("RBD_NBD_GO_STATE_DIR")
	if def == "" {
		def = "/run/rbd-nbd-go"
	}
	f.StringVar(&g.stateDir, "state-dir", def, "node state directory (devices, control socket, daemon log)")
}

// daemonCeph is the Ceph identity the node daemon gets: the keyfile is
// read here, because callers like ceph-csi delete it right after the
// map, and the daemon needs the key again to reattach after a restart.
func (g *globalOpts) daemonCeph() (ceph.Options, error) {
	o := g.ceph
	if o.Conf == "" {
		o.Conf = os.Getenv("CEPH_CONF")
	}
	if o.Keyfile != "" {
		b, err := os.ReadFile(o.Keyfile)
		if err != nil {
			return o, fmt.Errorf("keyfile: %w", unwrapPath(err))
		}
		o.Key = strings.TrimSpace(string(b))
		if o.Key == "" {
			return o, fmt.Errorf("keyfile %s is empty", o.Keyfile)
		}
		o.Keyfile = ""
	}
	return o, nil
}

// unwrapPath keeps "open F: permission denied" short and secret-free.
func unwrapPath(err error) error {
	if pe, ok := err.(*os.PathError); ok {
		return fmt.Errorf("%s: %w", pe.Path, pe.Err)
	}
	return err
}
