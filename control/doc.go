// Package control is the node daemon's control API: the device record
// and the map options it embeds (the CLI's flags, ceph-csi's mapOptions),
// the requests and responses spoken over the daemon's unix socket, a
// typed client, and starting the daemon when it is not running. It has
// no cgo and imports nothing that links librbd, so the CLI and the CSI
// driver use it without building the daemon's data path; the daemon
// (package daemon) answers it and package attach keeps the records.
package control
