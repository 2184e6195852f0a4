// Package kubelet holds what the kubelet needs from a CSI plugin besides
// CSI itself: plugin registration (the job of node-driver-registrar) and
// an HTTP liveness endpoint that asks the plugin's Probe (the job of the
// livenessprobe sidecar). Both are here so that a deployment needs no
// images but the driver's own; the upstream sidecars remain drop-in
// alternatives with the same flags.
package kubelet
