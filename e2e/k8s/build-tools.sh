#!/bin/bash
# Build the pinned Kubernetes binaries, CSI sidecars, and Kubernetes' own
# storage e2e suite (storage-e2e.test, ginkgo, agnhost) of e2e/k8s/tools
# (module proxy only) into a cache outside the checkout, keyed by the
# tools module's go.mod and go.sum, and print the directory holding them.
# A warm cache costs nothing; a cold one about six minutes on two cores,
# and a few more for the suite; with Go's build cache warm, relinking all
# takes 2.5.
#
# `populator` builds hello-populator of e2e/k8s/populator instead, keyed
# by that module alone: only make e2e-k8s-conformance needs it, so the
# tools make test uses are neither rebuilt nor slowed by it (about three
# minutes cold).
#
#   e2e/k8s/build-tools.sh            -> /var/cache/rbd-nbd-go-k8s/<hash>
#   e2e/k8s/build-tools.sh populator  -> /var/cache/rbd-nbd-go-k8s/populator-<hash>
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
tools=$here/tools prefix=
if [ "${1:-}" = populator ]; then
	tools=$here/populator prefix=populator-
elif [ $# -gt 0 ]; then
	echo "usage: build-tools.sh [populator]" >&2
	exit 2
fi
# The storage suite's own source too (a directory only tools/ has).
src=("$tools/go.mod" "$tools/go.sum")
[ -d "$tools/storage-e2e" ] && src+=("$tools"/storage-e2e/*.go)
hash=$(cat "${src[@]}" | sha256sum | cut -c1-16)
out=${K8S_TOOLS_CACHE:-/var/cache/rbd-nbd-go-k8s}/$prefix$hash
if [ -f "$out/.done" ]; then
	echo "$out"
	exit 0
fi

export PATH=/usr/local/go/bin:$PATH
mkdir -p "$out/bin"
# GOFLAGS from the main Makefile (-tags=pacific) mean nothing here. Every
# one of these builds without cgo, kubelet included.
cd "$tools"
# The tool directives, in a block or (go mod tidy's form for one) a line.
pkgs=$(awk '/^tool \(/ {b = 1; next} b && /^\)/ {b = 0; next} b {print $1; next} /^tool [^(]/ {print $2}' go.mod)
[ -n "$pkgs" ] || { echo "build-tools: no tool in $tools/go.mod" >&2; exit 1; }
for p in $pkgs; do
	name=${p##*/}
	[ -x "$out/bin/$name" ] && continue
	echo "build-tools: $name" >&2
	GOFLAGS=-trimpath CGO_ENABLED=0 go build -ldflags=-s -o "$out/bin/$name.tmp" "$p" >&2
	mv "$out/bin/$name.tmp" "$out/bin/$name"
done
# storage-e2e.test is Kubernetes' e2e suite with only its storage tests
# for external drivers (storage-e2e/: the External.Storage specs, run by
# the suite's own RunE2ETests), built as upstream's `make
# WHAT=test/e2e/e2e.test` builds the whole one, from the same pinned
# module.
if [ -z "$prefix" ] && [ ! -x "$out/bin/storage-e2e.test" ]; then
	echo "build-tools: storage-e2e.test" >&2
	GOFLAGS=-trimpath CGO_ENABLED=0 go test -c -ldflags=-s -o "$out/bin/storage-e2e.test.tmp" ./storage-e2e >&2
	mv "$out/bin/storage-e2e.test.tmp" "$out/bin/storage-e2e.test"
fi
touch "$out/.done"
echo "$out"
