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
GOFLAGS=-trimpath CGO_ENABLED=0 go build -ldflags=-s -o "$out/bin/helm.tmp" helm.sh/helm/v3/cmd/helm >&2
mv "$out/bin/helm.tmp" "$out/bin/helm"
echo "$out/bin/helm"
