#!/bin/bash
# Build the pinned Kubernetes binaries and CSI sidecars of e2e/k8s/tools
# (module proxy only) into a cache outside the checkout, keyed by the
# tools module's go.mod and go.sum, and print the directory holding them.
# A warm cache costs nothing; a cold one about six minutes on two cores.
#
#   e2e/k8s/build-tools.sh            -> /var/cache/rbd-nbd-go-k8s/<hash>
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
tools=$here/tools
hash=$(cat "$tools/go.mod" "$tools/go.sum" | sha256sum | cut -c1-16)
out=${K8S_TOOLS_CACHE:-/var/cache/rbd-nbd-go-k8s}/$hash
if [ -f "$out/.done" ]; then
	echo "$out"
	exit 0
fi

export PATH=/usr/local/go/bin:$PATH
mkdir -p "$out/bin"
# GOFLAGS from the main Makefile (-tags=pacific) mean nothing here. Every
# one of these builds without cgo, kubelet included.
cd "$tools"
pkgs=$(sed -n '/^tool (/,/^)/p' go.mod | grep -v -e '^tool (' -e '^)' | tr -d '\t')
for p in $pkgs; do
	name=${p##*/}
	[ -x "$out/bin/$name" ] && continue
	echo "build-tools: $name" >&2
	GOFLAGS=-trimpath CGO_ENABLED=0 go build -ldflags=-s -o "$out/bin/$name.tmp" "$p" >&2
	mv "$out/bin/$name.tmp" "$out/bin/$name"
done
touch "$out/.done"
echo "$out"
