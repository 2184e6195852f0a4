#!/bin/bash
# CPU by thread of the serving process (ours) or of fio with the rbd
# engine (direct), 4k randwrite QD32, on a fresh dev cluster each:
#   perthread.sh ours|direct     (REC=1: perf record instead of perf stat)
# Output in $OUT (default /tmp/pt): fio-<k>.json, perf-<k>.txt or rec-<k>.data.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
BIN=${BIN:-$PWD/bin/rbd-nbd-go}
OUT=${OUT:-/tmp/pt}
mkdir -p "$OUT"
k=${1:-ours}
D=$OUT/ceph
rm -rf "$D"
CEPH_CONF=$(scripts/ceph-dev-cluster start "$D")
export CEPH_CONF
trap 'scripts/ceph-dev-cluster stop "$D"' EXIT
rbd create --size 1G rbd/bench
fio --name=p --ioengine=rbd --pool=rbd --rbdname=bench --clientname=admin \
  --rw=write --bs=1M --iodepth=8 --size=1G >/dev/null 2>&1
job=(--name=t --rw=randwrite --bs=4k --iodepth=32 --runtime=12 --time_based --size=1G --output-format=json)
measure() { # pid: 10 s inside the 12 s run
  if [ -n "${REC:-}" ]; then
    perf record -F 4000 -g -p "$1" -o "$OUT/rec-$k.data" -- sleep 8 2>/dev/null
  else
    perf stat --per-thread -e task-clock,context-switches -p "$1" -o "$OUT/perf-$k.txt" -- sleep 10
  fi
}
if [ "$k" = ours ]; then
  rm -f "$OUT/s.sock"
  "$BIN" serve --socket "$OUT/s.sock" rbd/bench 2>"$OUT/serve.log" &
  sp=$!
  for _ in $(seq 50); do [ -S "$OUT/s.sock" ] && break; sleep 0.1; done
  fio --ioengine=nbd --uri="nbd+unix:///?socket=$OUT/s.sock" "${job[@]}" >"$OUT/fio-$k.json" &
  fp=$!
  sleep 1
  measure "$sp"
  wait "$fp"
  kill "$sp"
  wait "$sp" || true
else
  fio --ioengine=rbd --pool=rbd --rbdname=bench --clientname=admin "${job[@]}" >"$OUT/fio-$k.json" &
  fp=$!
  sleep 1
  measure "$(pgrep -n -x fio)"
  wait "$fp"
fi
