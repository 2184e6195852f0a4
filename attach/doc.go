// Package attach turns a device spec into a live /dev/nbdX: it opens the
// backend, serves it over socketpairs whose other ends it hands to the
// kernel, and keeps a record of every device in a state directory so that
// a restarted process can take the devices back (RECONFIGURE with the
// same cookie) before the kernel's dead-connection timeout fails any I/O.
//
// One Manager serves every device of a node: devices share RADOS
// connections per cluster identity, instead of one process and one
// cluster client per image as Ceph's rbd-nbd has it.
package attach
