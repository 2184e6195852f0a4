// Package ceph holds the plain Ceph types every layer passes around: a
// client identity (Options), an image name (ImageSpec), client-side
// encryption settings (Encryption). It has no cgo, so the CLI, the
// control API and the CSI driver build and unit-test without librbd;
// rbdio, the only package that links librbd, takes these as inputs.
package ceph
