#!/bin/bash
# Build the pinned helm of this directory's go.mod (module proxy only)
# into a cache outside the checkout, keyed by go.mod and go.sum, and
# print the binary's path. A warm cache costs nothing.
#
#   e2e/k8s/helm/build.sh       -> /var/cache/rbd-nbd-go-helm/<hash>/bin/helm
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
hash=$(cat "$here/go.mod" "$here/go.sum" | sha256sum | cut -c1-16)
out=${HELM_CACHE:-/var/cache/rbd-nbd-go-helm}/$hash
if [ -x "$out/bin/helm" ]; then
	echo "$out/bin/helm"
	exit 0
fi

export PATH=/usr/local/go/bin:$PATH
mkdir -p "$out/bin"
echo "helm/build.sh: building helm into $out" >&2
# GOFLAGS from the main Makefile (-tags=pacific) mean nothing here; helm
# builds without cgo.
cd "$here"
# The -X flags are those of helm's own Makefile: its version for `helm
# version`, and the Kubernetes version of its client-go (v0.N -> 1.N) for
# .Capabilities.KubeVersion and the lint's deprecation checks, which
# otherwise assume Kubernetes 1.20.
export GOFLAGS=
v=$(go list -m -f '{{.Version}}' helm.sh/helm/v3)
k=$(go list -m -f '{{.Version}}' k8s.io/client-go)
k=${k#v0.}
k=${k%%.*}
GOFLAGS=-trimpath CGO_ENABLED=0 go build -o "$out/bin/helm.tmp" -ldflags="-s \
	-X helm.sh/helm/v3/internal/version.version=$v \
	-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 \
	-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$k \
	-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 \
	-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$k" \
	helm.sh/helm/v3/cmd/helm >&2
mv "$out/bin/helm.tmp" "$out/bin/helm"
echo "$out/bin/helm"
