// Package kernel drives the Linux nbd driver: it hands connected sockets to
// /dev/nbdX and takes them back. It knows nothing of what serves those
// sockets — the caller runs an NBD server on the other ends.
//
// The generic-netlink interface is preferred: it lets the kernel pick the
// device, takes any number of sockets (one blk-mq queue each), and supports
// RECONFIGURE, the only way for a restarted server to take over a live
// device without an I/O error. The ioctl interface is the fallback for
// kernels (or containers) without the "nbd" genl family.
//
// BUG(kernel): the ioctl fallback cannot reattach: a device it set up dies
// with the process that configured it.
package kernel
