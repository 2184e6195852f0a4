package control

import (
	"errors"
	"path/filepath"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
)

// The daemon answers one JSON Request with one JSON Response per
// connection on a unix socket in the state directory (mode 0600, in a
// 0700 directory: root only).

// Request ops.
const (
	OpMap    = "map"
	OpAttach = "attach"
	OpUnmap  = "unmap"
	OpDetach = "detach"
	OpList   = "list"
	OpPing   = "ping"
	OpStatus = "status"
	// OpStats reads every device's request counters (iostat).
	OpStats = "stats"
)

// Request is one call to the daemon.
type Request struct {
	Op     string  `json:"op"`
	Record *Record `json:"record,omitempty"`
	Target string  `json:"target,omitempty"` // device path or spec
	// Cookie, if set, makes unmap act only on a device that carries it.
	Cookie string `json:"cookie,omitempty"`
	// Usage asks OpStatus for the allocated bytes, which may cost OSD
	// reads (without fast-diff it is not computed at all).
	Usage bool `json:"usage,omitempty"`
}

// Response codes besides success.
const (
	CodeNotMapped = "not_mapped"
	CodeBusy      = "busy"
	// CodeHandingOver: the daemon is passing its devices to a new one,
	// which answers on the same socket in a moment; the client retries.
	CodeHandingOver = "handing_over"
	CodeError       = "error"
)

// sentinels cross the socket as codes, so a client's errors.Is sees what
// the daemon saw: ceph's (image or pool missing, permission, lock held,
// cluster unreachable) as well as the daemon's own.
// The first that matches an error gives its code.
func sentinels() []struct {
	code string
	err  error
} {
	return []struct {
		code string
		err  error
	}{
		{CodeNotMapped, ErrNotMapped},
		{CodeBusy, ErrBusy},
		{CodeHandingOver, ErrHandingOver},
		{"image_not_found", ceph.ErrImageNotFound},
		{"pool_not_found", ceph.ErrPoolNotFound},
		{"permission", ceph.ErrPermission},
		{"locked", ceph.ErrLocked},
		{"unreachable", ceph.ErrUnreachable},
		{"in_use", ceph.ErrImageInUse},
		{"bad_passphrase", ceph.ErrBadPassphrase},
	}
}

// Response is the daemon's answer. Records in it never carry secrets.
type Response struct {
	Code  string `json:"code,omitempty"`
	Error string `json:"error,omitempty"`
	PID   int    `json:"pid"`
	// Instance tells daemons apart (pids repeat across containers): a
	// random word each daemon picks at start.
	Instance string        `json:"instance,omitempty"`
	Record   *Record       `json:"record,omitempty"`
	List     []Record      `json:"list,omitempty"`
	Status   *Status       `json:"status,omitempty"`
	Stats    []DeviceStats `json:"stats,omitempty"`
}

// DeviceStats is one device's request counters since its map (or the
// daemon's start).
type DeviceStats struct {
	Record Record       `json:"record"`
	Stats  nbd.Snapshot `json:"stats"`
	// Replaced counts dead sockets replaced after the kernel's
	// LINK_DEAD, Reattached new sockets after a detach or a restart,
	// Resized the image growing under the device.
	Replaced   uint64 `json:"replaced"`
	Reattached uint64 `json:"reattached"`
	Resized    uint64 `json:"resized"`
}

// Status is how a device is doing, as the daemon sees it: what a CSI
// driver's volume health and raw-block statistics need.
type Status struct {
	Record Record `json:"record"`
	// Served: the daemon serves the device (not detached).
	Served bool `json:"served"`
	// Connections is how many the device has; Live how many of them the
	// daemon is serving now. Live 0 on a served device means the kernel
	// has no working connection (it waits for a reattach, or gave up).
	Connections int `json:"connections"`
	Live        int `json:"live"`
	// Size is the backend's size in bytes.
	Size uint64 `json:"size"`
	// Used is the bytes the image has allocated, when the backend can
	// tell cheaply (RBD with fast-diff); UsedError says why not.
	Used      *uint64 `json:"used,omitempty"`
	UsedError string  `json:"used_error,omitempty"`
}

// ErrNotMapped: the device or spec is not served on this node.
var ErrNotMapped = errors.New("not mapped")

// ErrBusy: the device is mounted or held open exclusively.
var ErrBusy = errors.New("device is busy")

// ErrHandingOver: the daemon is handing its devices to a new daemon
// (an upgrade); the same request succeeds once the new one answers.
var ErrHandingOver = errors.New("the node daemon is handing its devices over to a new one")

// Failure turns a daemon-side error into a response; its sentinel
// survives the trip (Response.Err).
func Failure(err error) Response {
	r := Response{Code: CodeError, Error: err.Error()}
	for _, s := range sentinels() {
		if errors.Is(err, s.err) {
			r.Code = s.code
			break
		}
	}
	return r
}

// Err turns a failed response into an error that errors.Is recognises.
func (r Response) Err() error {
	switch r.Code {
	case "":
		return nil
	case CodeNotMapped:
		return ErrNotMapped
	}
	for _, s := range sentinels() {
		if s.code == r.Code {
			return codeError{r.Error, s.err}
		}
	}
	return errors.New(r.Error)
}

// codeError keeps the daemon's message and matches its sentinel.
type codeError struct {
	msg    string
	target error
}

func (e codeError) Error() string        { return e.msg }
func (e codeError) Is(target error) bool { return target == e.target }

// SocketPath is the control socket in a state directory.
func SocketPath(stateDir string) string { return filepath.Join(stateDir, "control.sock") }

// RecordsDir holds one record file per device (nbdN.json).
func RecordsDir(stateDir string) string { return filepath.Join(stateDir, "devices") }

// LogPath is where a daemon started by Start logs.
func LogPath(stateDir string) string { return filepath.Join(stateDir, "daemon.log") }

// hasRecords reports whether devices are recorded: a restarted node's
// devices need their server back even for a call that starts nothing.
func hasRecords(stateDir string) bool {
	m, _ := filepath.Glob(filepath.Join(RecordsDir(stateDir), "nbd*.json"))
	return len(m) > 0
}
