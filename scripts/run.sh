#!/usr/bin/env bash
# make run: serve a sparse 1 GiB file over NBD on a unix socket, prove it
# works with real clients, then keep serving until Ctrl-C.
set -euo pipefail
bin=${1:-bin/rbd-nbd-go}
state=${RBD_NBD_GO_RUN_DIR:-/tmp/rbd-nbd-go-run}
mkdir -p "$state"
chmod 700 "$state"
disk=$state/disk.img
sock=$state/nbd.sock
[ -f "$disk" ] || truncate -s 1G "$disk"
uri="nbd+unix:///?socket=$sock"

"$bin" serve --socket "$sock" --name "" "file:$disk" &
pid=$!
trap 'kill -TERM $pid 2>/dev/null; wait $pid' INT TERM
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.05; done
[ -S "$sock" ] || { echo "server did not start" >&2; exit 1; }

echo "== nbdinfo $uri"
nbdinfo "$uri"
echo "== write 4 MiB of pattern 0xa5 with qemu-io and read it back verified"
qemu-io -f raw "$uri" -c 'write -P 0xa5 1M 4M' -c 'flush' -c 'read -P 0xa5 1M 4M' | grep -E 'wrote|read'
echo "== the same bytes are in the backing file:"
cmp <(head -c 4M /dev/zero | tr '\0' '\245') <(dd if="$disk" bs=1M skip=1 count=4 status=none) && echo "   $disk matches"
echo "== allocation map (nbdinfo --map)"
nbdinfo --map "$uri" | head -5
cat <<MSG

Serving $disk (pid $pid). Connect with, for example:
  nbdinfo '$uri'
  qemu-io -f raw '$uri' -c 'read -v 1M 64'
  fio --name=x --ioengine=nbd --uri='$uri' --rw=randread --bs=4k --iodepth=32 --runtime=10 --time_based
Press Ctrl-C to stop (requests in flight finish, data is flushed).
MSG
wait $pid
