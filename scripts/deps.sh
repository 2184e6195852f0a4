#!/usr/bin/env bash
# Installs what the build, tests and benchmarks need, only when missing.
# Safe to run repeatedly; needs root (or sudo) only when something is missing.
set -euo pipefail

pkgs=(
  fio            # workload generator with the nbd ioengine (tests, bench)
  libnbd-bin     # nbdinfo, nbdcopy, nbdsh
  python3-libnbd # nbdsh's python binding
  nbdkit         # peer server for the bench
  qemu-utils     # qemu-io, qemu-img
  qemu-block-extra # qemu-nbd's rbd driver: the host bench's NBD peer on librbd
  ceph-mon ceph-osd ceph-common # the dev cluster (scripts/ceph-dev-cluster), rbd tool
  librbd-dev librados-dev       # cgo headers and libraries for rbdio
  libradospp-dev g++            # librbd's C++ API: lent reads (rbdio/lend.cc)
  libjemalloc2                  # malloc for librbd in our process (see rbdio/memory.go)
  gcc libc6-dev                 # cgo
  mount                         # losetup, for the block-device test
  qemu-system-x86 busybox-static # the kernel-NBD VM rig (scripts/vm)
  e2fsprogs xfsprogs util-linux  # mkfs, blockdev, fsfreeze in the VM scenarios
  rbd-nbd                        # Ceph's own rbd-nbd: the VM bench's peer
  cryptsetup-bin                 # ceph-csi's encryption in the VM: LUKS2 + dm-crypt (bench, migration)
  ca-certificates
  etcd-server containerd runc containernetworking-plugins # e2e-k8s: a cluster in the VM
  openssl                        # e2e-k8s: the cluster's certificates
)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "deps: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

export PATH="/usr/local/go/bin:$PATH"
if ! command -v go >/dev/null; then
  echo "deps: Go 1.26 is required (expected at /usr/local/go); Debian 12's golang package is too old" >&2
  exit 1
fi
go mod download
