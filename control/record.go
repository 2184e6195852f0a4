package control

import (
	"errors"
	"fmt"
	"regexp"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
	"github.com/rbd-nbd-go/rbd-nbd-go/devspec"
)

// AnyIndex in Record.Index lets the kernel choose (or create) the device.
const AnyIndex = -1

// MaxConnections bounds the sockets (kernel queues) of one device.
const MaxConnections = 64

// Record is everything needed to serve a device again after a restart.
// It holds the Ceph key (the keyfile it came from is often gone by then),
// so records are written 0600 in a 0700 directory under /run: root only,
// never on disk.
type Record struct {
	Index  int    `json:"index"`
	Spec   string `json:"spec"`
	Cookie string `json:"cookie"`

	// Embedded, so the options stay fields of the record in Go and keys
	// of its JSON: saved records and the control protocol read as
	// before.
	MapOptions

	Ceph       ceph.Options    `json:"ceph"`
	Encryption ceph.Encryption `json:"encryption,omitzero"`

	// PVC and PVCNamespace name the Kubernetes claim a CSI volume serves,
	// when the provisioner passed them: labels of the device's metrics.
	PVC          string `json:"pvc,omitempty"`
	PVCNamespace string `json:"pvc_namespace,omitempty"`

	// Detached devices keep their kernel side (waiting for a reattach)
	// but are not served, and a restart does not reattach them.
	Detached bool `json:"detached,omitempty"`
}

// k8sName matches a Kubernetes object name (DNS subdomain), or nothing.
var k8sName = regexp.MustCompile(`^([a-z0-9]([-a-z0-9.]*[a-z0-9])?)?$`)

// Device is the device node path.
func (r Record) Device() string { return fmt.Sprintf("/dev/nbd%d", r.Index) }

// Public is r without its secrets: what may leave the daemon or be logged.
func (r Record) Public() Record {
	r.Ceph.Key = ""
	r.Encryption.Passphrase = ""
	return r
}

// Defaults fills what a caller left unset.
func (r *Record) Defaults() {
	if r.Connections <= 0 {
		r.Connections = 1
	}
	if r.BlockSize == 0 {
		r.BlockSize = 4096
	}
	if r.ReattachTimeout <= 0 {
		r.ReattachTimeout = 30 * time.Second
	}
}

// Validate checks a map or attach request before any device or image is
// touched. It runs twice on a map, at the two boundaries: control.Client
// runs it to fail fast, and the daemon's control server runs it again on
// what it receives, whoever sent it. The options are checked by
// MapOptions.Validate.
func (r Record) Validate() error {
	if r.Index < AnyIndex {
		return fmt.Errorf("bad device index %d", r.Index)
	}
	if err := r.MapOptions.Validate(); err != nil {
		return err
	}
	sp, err := devspec.Parse(r.Spec)
	if err != nil {
		return err
	}
	// Kubernetes names: a DNS subdomain, a namespace a DNS label. They
	// become metric labels, so nothing longer or stranger gets in.
	if !k8sName.MatchString(r.PVC) || len(r.PVC) > 253 || !k8sName.MatchString(r.PVCNamespace) || len(r.PVCNamespace) > 63 {
		return fmt.Errorf("bad PVC %q in namespace %q: want Kubernetes names", r.PVC, r.PVCNamespace)
	}
	if !sp.IsRBD() && (r.Exclusive || r.Encryption.Format != "") {
		return errors.New("exclusive lock and encryption apply to RBD images only")
	}
	if r.Encryption != (ceph.Encryption{}) {
		if r.Encryption.Format == "" {
			return errors.New("an encryption passphrase needs an encryption format")
		}
		if err := r.Encryption.Validate(); err != nil {
			return err
		}
	}
	return nil
}
