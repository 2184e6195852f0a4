// Package csi is the CSI driver: Identity, Controller and Node services
// for RBD images served as /dev/nbdX by the node daemon.
//
// It is built to be a drop-in for ceph-csi's `mounter: rbd-nbd`: the same
// clusters config.json, StorageClass parameters and Secret keys. The
// controller manages images through rbdio (behind the Images interface);
// the node service maps through the node daemon's control API (behind
// the NodeDaemon interface) and formats and mounts with k8s.io/mount-utils.
// Neither links librbd here: cmd/ wires the real implementations, and
// unit tests use fakes.
//
// What it does that ceph-csi's nbd mounter cannot: devices are served by
// the node daemon, which a restarted plugin starts again at once; the
// daemon reattaches every device from its state directory before the
// kernel's dead-connection timeout, so applications see no I/O error
// (ceph-csi #667).
package csi
