#!/bin/bash
# Build the driver's container image with no registry and no container
# builder: the rbd-nbd-go binary, every library it links (librbd,
# librados, jemalloc, ...) and the mkfs/mount/fs tools the node plugin
# runs, all taken from this Debian 12 machine — the same contents the
# Containerfile beside this script installs from Debian's packages.
# The result is a docker-archive tarball that `ctr images import` (and
# `docker load`, `podman load`) accepts.
#
#   deploy/image/build-local.sh driver BINARY IMAGE_NAME OUT.tar
#   deploy/image/build-local.sh static BINARY 'ENTRYPOINT [ARG...]' IMAGE_NAME OUT.tar
#   deploy/image/build-local.sh tools 'TOOL...' IMAGE_NAME OUT.tar
#   [E2E_GNU='TOOL...'] deploy/image/build-local.sh e2e [AGNHOST] IMAGE_NAME OUT.tar
#
# static makes a one-binary image (the CSI sidecars, built from the module
# proxy, are static; a pause image); tools a test image of busybox plus
# the named tools and their libraries; e2e a stand-in for Kubernetes'
# e2e test images (busybox's applets as alpine's, and a static agnhost
# as the entrypoint when one is given; E2E_GNU names tools of this
# machine that replace busybox's, for an image built on Debian).
set -euo pipefail

die() { echo "build-local: $*" >&2; exit 1; }

work=$(mktemp -d /tmp/image.XXXXXX)
trap 'rm -rf "$work"' EXIT
root=$work/rootfs
mkdir -p "$root"/{etc,tmp,run,dev,proc,sys,usr/bin,usr/sbin,usr/lib,usr/lib64}
# Debian 12's merged /usr, made before anything is copied through it.
for d in bin sbin lib lib64; do ln -s usr/$d "$root/$d"; done
chmod 1777 "$root/tmp"

# add_elf PATH: an executable and every library it links, at the paths
# the loader looks for them.
add_elf() {
	install -D -m 0755 "$1" "$root$1"
	head -c4 "$1" | grep -q ELF || return 0
	ldd "$1" 2>/dev/null | awk '/=> \// {print $3} /^[ \t]*\/lib/ {print $1}' | while read -r lib; do
		[ -e "$root$lib" ] || cp --parents -L "$lib" "$root/"
	done
}
# add_tools NAME...: commands from this machine's PATH, under their own
# names (mkfs.ext4 is mke2fs, sh is dash: the name gets a link).
add_tools() {
	local t p
	for t in "$@"; do
		p=$(PATH=/usr/sbin:/usr/bin:/sbin:/bin command -v "$t") || die "$t missing (make deps installs it)"
		p=$(readlink -f "$p")
		add_elf "$p"
		[ "${p##*/}" = "$t" ] || ln -sf "$p" "$root${p%/*}/$t"
	done
}

mode=${1:-}
case $mode in
driver)
	[ $# -eq 4 ] || die "usage: build-local.sh driver BINARY IMAGE_NAME OUT.tar"
	bin=$(readlink -f "$2") name=$3 out=$4
	add_elf "$bin"
	mv "$root$bin" "$root/usr/bin/rbd-nbd-go"
	# What the node plugin runs: mount-utils' SafeFormatAndMount (blkid,
	# fsck, mkfs, mount), ResizeFs (resize2fs, xfs_growfs), and a shell
	# for fsck.xfs (a script) and for debugging.
	add_tools mount umount blkid fsck fsck.ext4 e2fsck mkfs.ext4 mke2fs resize2fs mkfs.xfs xfs_growfs \
		xfs_repair fsck.xfs blockdev findmnt sh dash
	# librados loads its compressor, crypto and erasure-code plugins at
	# run time, from here.
	cp -a --parents /usr/lib/x86_64-linux-gnu/ceph "$root/"
	cp /etc/mke2fs.conf "$root/etc/"
	ln -s /proc/self/mounts "$root/etc/mtab"
	entrypoint='["/usr/bin/rbd-nbd-go"]'
	;;
static)
	[ $# -eq 5 ] || die "usage: build-local.sh static BINARY ENTRYPOINT IMAGE_NAME OUT.tar"
	bin=$2 entry=$3 name=$4 out=$5
	if ldd "$bin" >/dev/null 2>&1; then die "$bin is not static"; fi
	# ENTRYPOINT's first word is where the binary goes; the rest are
	# its arguments ("/pause sleep 2147483647" for busybox as pause).
	read -r -a words <<<"$entry"
	install -D -m 0755 "$bin" "$root${words[0]}"
	entrypoint=$(printf '"%s",' "${words[@]}")
	entrypoint="[${entrypoint%,}]"
	;;
tools)
	# A test image: busybox's applets plus the named tools (fio, ...).
	[ $# -eq 4 ] || die "usage: build-local.sh tools 'TOOL...' IMAGE_NAME OUT.tar"
	name=$3 out=$4
	install -D -m 0755 /bin/busybox "$root/usr/bin/busybox"
	for a in $(/bin/busybox --list); do [ -e "$root/usr/bin/$a" ] || ln -s busybox "$root/usr/bin/$a"; done
	# shellcheck disable=SC2086
	add_tools $2
	entrypoint='["/usr/bin/sh"]'
	;;
e2e)
	[ $# -eq 3 ] || [ $# -eq 4 ] || die "usage: build-local.sh e2e [AGNHOST] IMAGE_NAME OUT.tar"
	name=${*: -2:1} out=${*: -1}
	install -D -m 0755 /bin/busybox "$root/usr/bin/busybox"
	for a in $(/bin/busybox --list); do [ -e "$root/usr/bin/$a" ] || ln -s busybox "$root/usr/bin/$a"; done
	for t in ${E2E_GNU:-}; do rm -f "$root/usr/bin/$t"; done
	# shellcheck disable=SC2086
	[ -z "${E2E_GNU:-}" ] || add_tools $E2E_GNU
	entrypoint='["/usr/bin/sh"]'
	if [ $# -eq 4 ]; then
		if ldd "$2" >/dev/null 2>&1; then die "$2 is not static"; fi
		install -m 0755 "$2" "$root/agnhost"
		mkdir -p "$root/uploads"
		entrypoint='["/agnhost"]'
	fi
	;;
*) die "usage: build-local.sh driver|static|tools|e2e ..." ;;
esac
printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n' >"$root/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' >"$root/etc/group"

# docker-archive: one layer, its config, and a manifest naming the image.
# Fixed mtimes and owners, so equal inputs give an equal image ID.
tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$root" -cf "$work/layer.tar" .
diff=$(sha256sum "$work/layer.tar" | cut -d' ' -f1)
cat >"$work/config.json" <<EOF
{"architecture":"amd64","os":"linux","created":"1970-01-01T00:00:00Z",
 "config":{"Entrypoint":$entrypoint,"Env":["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]},
 "rootfs":{"type":"layers","diff_ids":["sha256:$diff"]}}
EOF
cfg=$(sha256sum "$work/config.json" | cut -d' ' -f1)
mkdir -p "$work/archive/$diff"
mv "$work/layer.tar" "$work/archive/$diff/layer.tar"
mv "$work/config.json" "$work/archive/$cfg.json"
printf '[{"Config":"%s.json","RepoTags":["%s"],"Layers":["%s/layer.tar"]}]\n' "$cfg" "$name" "$diff" >"$work/archive/manifest.json"
mkdir -p "$(dirname "$out")"
tar --sort=name --mtime=@0 --owner=0 --group=0 -C "$work/archive" -cf "$out.tmp" .
mv "$out.tmp" "$out"
echo "build-local: $name -> $out ($(du -h "$out" | cut -f1))" >&2
