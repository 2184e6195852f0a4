#!/bin/bash
# The images e2e-k8s gives the VM's containerd, as docker-archive
# tarballs in OUTDIR: the driver (deploy/image/build-local.sh, from
# bin/rbd-nbd-go), the CSI sidecars and the snapshot-controller under
# their upstream names and the versions pinned in e2e/k8s/tools/go.mod
# (built from the same sources), a pause image, and the test pods' image
# (busybox and fio). Then e2e/k8s/containerd-root.sh imports them all
# into OUTDIR/containerd-root, which the VM's containerd starts from.
#
#   e2e/k8s/images.sh OUTDIR
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$1
mkdir -p "$out"
tools=$(e2e/k8s/build-tools.sh)
# helm for the deploy scenario's chart check, built here: the VM finds it
# in the cache, where a build under TCG would take many minutes.
e2e/k8s/helm/build.sh >/dev/null
b=deploy/image/build-local.sh
ver() { awk -v m="$1" '$1 == m {print $2}' e2e/k8s/tools/go.mod; }
$b driver bin/rbd-nbd-go localhost/rbd-nbd-go:dev "$out/rbd-nbd-go.tar"
for s in csi-provisioner:external-provisioner/v6 csi-attacher:external-attacher/v4 csi-resizer:external-resizer/v2 \
	csi-snapshotter:external-snapshotter/v8 snapshot-controller:external-snapshotter/v8; do
	name=${s%%:*}
	v=$(ver "github.com/kubernetes-csi/${s#*:}")
	[ -n "$v" ] || { echo "images: no version for $name in e2e/k8s/tools/go.mod" >&2; exit 1; }
	$b static "$tools/bin/$name" "/$name" "registry.k8s.io/sig-storage/$name:$v" "$out/$name.tar"
done
$b static /bin/busybox "/bin/busybox sleep 2147483647" localhost/pause:local "$out/pause.tar"
$b tools fio localhost/e2e-app:dev "$out/e2e-app.tar"
# Kubernetes' e2e suite (make e2e-k8s-conformance): its test images under
# their upstream names and tags (test/utils/image/manifest.go at the
# pinned version), so no pod pulls. agnhost is built from that source;
# busybox is Debian's, and stands in for nginx and glibc-dns-testing too,
# which the suite's storage tests run only for a shell and its tools;
# glibc-dns-testing is Debian-based, and multiVolume's checks use GNU
# dd's oflag=nocache, so it gets this machine's dd, and dash as sh:
# busybox's sh runs its own applets before PATH's.
k8s_ver=$(ver k8s.io/kubernetes)
manifest=$(cd e2e/k8s/tools && GOFLAGS= /usr/local/go/bin/go list -m -f '{{.Dir}}' k8s.io/kubernetes)/test/utils/image/manifest.go
tag() { sed -n "s/.*configs\[$1\] = Config{list.PromoterE2eRegistry, \"\([a-z-]*\)\", \"\([^\"]*\)\"}.*/\1:\2/p" "$manifest"; }
for img in BusyBox:busybox Nginx:busybox GlibcDnsTesting:busybox Agnhost:agnhost; do
	t=$(tag "${img%%:*}")
	[ -n "$t" ] || { echo "images: no ${img%%:*} in $manifest ($k8s_ver)" >&2; exit 1; }
	if [ "${img#*:}" = agnhost ]; then
		$b e2e "$tools/bin/agnhost" "registry.k8s.io/e2e-test-images/$t" "$out/e2e-${t%%:*}.tar"
	elif [ "${img%%:*}" = GlibcDnsTesting ]; then
		E2E_GNU="sh dd" $b e2e "registry.k8s.io/e2e-test-images/$t" "$out/e2e-${t%%:*}.tar"
	else
		$b e2e "registry.k8s.io/e2e-test-images/$t" "$out/e2e-${t%%:*}.tar"
	fi
done
# hello-populator, for the spec "provisioning should provision storage
# with any volume data source" (make e2e-k8s-conformance sets
# E2E_POPULATOR=1), under the name its manifest gives at the pinned
# version. Static, one binary: its populate pods run it too.
if [ "${E2E_POPULATOR:-}" = 1 ]; then
	pop=$(e2e/k8s/build-tools.sh populator)
	deploy=${manifest%/test/utils/image/manifest.go}/test/e2e/testing-manifests/storage-csi/any-volume-datasource/hello-populator-deploy.yaml
	img=$(sed -n 's/^ *image: *\(.*hello-populator:[^ ]*\) *$/\1/p' "$deploy" | head -1)
	[ -n "$img" ] || { echo "images: no hello-populator image in $deploy" >&2; exit 1; }
	$b static "$pop/bin/hello-populator" /hello-populator "$img" "$out/hello-populator.tar"
else
	rm -f "$out/hello-populator.tar" # a conformance run's, not imported by others
fi
e2e/k8s/containerd-root.sh "$out"
