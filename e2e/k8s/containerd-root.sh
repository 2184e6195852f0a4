#!/bin/bash
# Import the image tarballs of IMAGES_DIR into a containerd root,
# IMAGES_DIR/containerd-root, on this host, for the VM's containerd to
# start from (e2e/k8s/cluster.sh copies it in). An import hashes every
# blob: in the TCG VM it ran at 3.4 MB/s (Go's SHA-256 alone at 10-12),
# 3.5 minutes of every e2e-k8s deploy for its 575 MB, against 13 s here. The import is the one the VM made (namespace
# k8s.io, not unpacked: the kubelet's first container of each image
# unpacks it there, as before), by Debian's containerd, the VM's own.
#
#   e2e/k8s/containerd-root.sh IMAGES_DIR
#
# A private containerd: its own root, state and socket under a temporary
# directory; no CRI plugin, no /opt/containerd.
set -euo pipefail
dir=$(cd "$1" && pwd)
out=$dir/containerd-root
tmp=$(mktemp -d /tmp/containerd-root.XXXXXX)
pid=
cleanup() {
	[ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
	rm -rf "$tmp"
}
trap cleanup EXIT
mkdir -p "$tmp/root" "$tmp/state"
cat >"$tmp/config.toml" <<CONF
version = 2
root = "$tmp/root"
state = "$tmp/state"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.internal.v1.opt"]
[grpc]
  address = "$tmp/state/containerd.sock"
CONF
containerd --config "$tmp/config.toml" >"$tmp/containerd.log" 2>&1 &
pid=$!
sock=$tmp/state/containerd.sock
for _ in $(seq 100); do
	ctr -a "$sock" version >/dev/null 2>&1 && break
	kill -0 "$pid" 2>/dev/null || { tail -5 "$tmp/containerd.log" >&2; echo "containerd-root: containerd did not start" >&2; exit 1; }
	sleep 0.1
done
n=0
for img in "$dir"/*.tar; do
	ctr -n k8s.io -a "$sock" images import --no-unpack "$img" >/dev/null ||
		{ tail -5 "$tmp/containerd.log" >&2; echo "containerd-root: importing $img failed" >&2; exit 1; }
	n=$((n + 1))
done
[ "$n" -gt 0 ] || { echo "containerd-root: no image tarball in $dir" >&2; exit 1; }
# Stopped before the copy: its metadata database is then closed.
kill "$pid"
wait "$pid" 2>/dev/null || true
pid=
rm -rf "$out"
mv "$tmp/root" "$out"
echo "containerd-root: $n images in $out ($(du -sh "$out" | cut -f1))"
