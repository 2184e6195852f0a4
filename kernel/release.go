package kernel

import (
	"strconv"
	"strings"
)

// Release is the running kernel's release (uname -r), "unknown" if
// uname fails.
func Release() string { return release() }

// ResendsOnNewSocket reports whether a kernel of this release, on a
// device of one connection with NBD's own timeout at 0, sends a request
// again once its socket has been replaced: Linux 5.7 brought both
// halves, replacing the socket of a one-connection device and requeuing
// a request whose socket changed when its block-layer timer fires
// (Hou Pu's "nbd: enable replace socket if only one connection is
// configured" and "nbd: requeue command if the soecket is changed").
// Before that such a request waited for good after a daemon restart.
// A release it cannot read is taken as too old.
func ResendsOnNewSocket(release string) bool {
	major, rest, _ := strings.Cut(release, ".")
	minor := rest
	if i := strings.IndexFunc(rest, func(r rune) bool { return r < '0' || r > '9' }); i >= 0 {
		minor = rest[:i]
	}
	ma, err1 := strconv.Atoi(major)
	mi, err2 := strconv.Atoi(minor)
	if err1 != nil || err2 != nil {
		return false
	}
	return ma > 5 || ma == 5 && mi >= 7
}
