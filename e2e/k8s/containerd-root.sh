#!/bin/bash
# Import the image tarballs of IMAGES_DIR into a containerd root,
# IMAGES_DIR/containerd-root, on this host, for the VM's containerd to
# start from (e2e/k8s/cluster.sh copies it in). An import hashes every
# blob: on an idle TCG VM it ran at 3.4 MB/s (Go's SHA-256 alone at
# 10-12), about 3.5 minutes of a loaded e2e-k8s deploy for its 575 MB,
# against 13 s here. The import is the one the VM made (namespace
# k8s.io, not unpacked: the kubelet's first container of each image
# unpacks it there, as before), by Debian's containerd, the VM's own.
#
#   e2e/k8s/containerd-root.sh IMAGES_DIR
#
# A private containerd: its own root (beside the result, so the last
# step is a rename), state and socket; no CRI plugin, no /opt/containerd.
set -euo pipefail
shopt -s nullglob
dir=$(cd "$1" && pwd)
out=$dir/containerd-root
tars=("$dir"/*.tar)
[ ${#tars[@]} -gt 0 ] || { echo "containerd-root: no image tarball in $dir" >&2; exit 1; }
new=$(mktemp -d "$dir/.containerd-root.XXXXXX")
tmp=$(mktemp -d /tmp/containerd-root.XXXXXX)
pid=
cleanup() {
	if [ -n "$pid" ]; then
		kill "$pid" 2>/dev/null || true
		wait "$pid" 2>/dev/null || true
	fi
	rm -rf "$tmp" "$new"
}
trap cleanup EXIT
cat >"$tmp/config.toml" <<CONF
version = 2
root = "$new"
state = "$tmp/state"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.internal.v1.opt"]
[grpc]
  address = "$tmp/state/containerd.sock"
CONF
containerd --config "$tmp/config.toml" >"$tmp/containerd.log" 2>&1 &
pid=$!
sock=$tmp/state/containerd.sock
up=0
for _ in $(seq 300); do
	ctr -a "$sock" version >/dev/null 2>&1 && { up=1; break; }
	kill -0 "$pid" 2>/dev/null || break
	sleep 0.1
done
[ $up = 1 ] || { tail -5 "$tmp/containerd.log" >&2; echo "containerd-root: containerd did not start" >&2; exit 1; }
for img in "${tars[@]}"; do
	ctr -n k8s.io -a "$sock" images import --no-unpack "$img" >/dev/null ||
		{ tail -5 "$tmp/containerd.log" >&2; echo "containerd-root: importing $img failed" >&2; exit 1; }
done
# Stopped before the rename: its metadata database is then closed.
kill "$pid"
wait "$pid" 2>/dev/null || true
pid=
rm -rf "$out"
mv "$new" "$out"
n=${#tars[@]}
echo "containerd-root: $n images in $out ($(du -sh "$out" | cut -f1))"
