#!/usr/bin/env bash
# make run: serve an RBD image over NBD, prove it end to end, keep serving.
# With CEPH_CONF pointing at a cluster, that cluster is used; otherwise a
# local dev cluster is started in $RBD_NBD_GO_RUN_DIR (and stopped on exit).
set -euo pipefail
bin=${1:-bin/rbd-nbd-go}
here=$(cd "$(dirname "$0")" && pwd)
state=${RBD_NBD_GO_RUN_DIR:-/tmp/rbd-nbd-go-run}
mkdir -p "$state"
chmod 700 "$state"
sock=$state/nbd.sock
image=${RBD_NBD_GO_IMAGE:-rbd/rbd-nbd-go-demo}
uri="nbd+unix:///?socket=$sock"

started_cluster=""
if [ -n "${CEPH_CONF:-}" ] && [ -f "$CEPH_CONF" ]; then
  echo "== [1/5] using the cluster in CEPH_CONF=$CEPH_CONF"
else
  echo "== [1/5] starting a local dev Ceph cluster in $state/ceph (seconds)"
  CEPH_CONF=$("$here/ceph-dev-cluster" start "$state/ceph")
  export CEPH_CONF
  started_cluster=$state/ceph
fi
pid=""
# Only the EXIT trap cleans up: Ctrl-C exits, which runs it once.
cleanup() {
  [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
  [ -n "$started_cluster" ] && "$here/ceph-dev-cluster" stop "$started_cluster" && echo "== dev cluster stopped"
  return 0
}
trap 'exit 0' INT TERM
trap cleanup EXIT

rbd info "$image" >/dev/null 2>&1 || rbd create --size 1G "$image"
echo "== [2/5] serving $image on $sock"
# A socket left by a killed run would pass the wait below before the new
# server is up (serve itself replaces it): the directory is ours alone.
rm -f "$sock"
"$bin" serve --socket "$sock" "$image" &
pid=$!
for _ in $(seq 200); do [ -S "$sock" ] && break; kill -0 "$pid" 2>/dev/null || exit 1; sleep 0.05; done
[ -S "$sock" ] || { echo "server did not start" >&2; exit 1; }

nbdinfo "$uri" | sed 's/^/   /'
echo "== [3/5] writing 4 MiB of pattern 0xa5 at 1 MiB through NBD (qemu-io), with a flush"
qemu-io -f raw "$uri" -c 'write -P 0xa5 1M 4M' -c 'flush' | grep -E '^wrote' | sed 's/^/   /'
echo "== [4/5] reading it back from Ceph with rbd export and comparing"
rbd export "$image" "$state/export.raw" >/dev/null 2>&1
if cmp <(head -c 4M /dev/zero | tr '\0' '\245') <(dd if="$state/export.raw" bs=1M skip=1 count=4 status=none); then
  echo "   rbd export matches what was written through NBD"
else
  echo "   MISMATCH between NBD writes and rbd export" >&2
  exit 1
fi
rm -f "$state/export.raw"
cat <<MSG
== [5/5] serving until Ctrl-C

Serving $image over NBD (pid $pid), cluster: $CEPH_CONF
Connect with, for example:
  nbdinfo '$uri'
  qemu-io -f raw '$uri' -c 'read -P 0xa5 1M 4M'
  fio --name=x --ioengine=nbd --uri='$uri' --rw=randread --bs=4k --iodepth=32 --runtime=10 --time_based
  CEPH_CONF=$CEPH_CONF rbd du $image
Press Ctrl-C to stop: requests in flight finish, the server exits$( [ -n "$started_cluster" ] && echo ", and the dev cluster stops").
MSG
wait "$pid"
