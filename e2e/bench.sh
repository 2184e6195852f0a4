#!/bin/bash
# Kernel-NBD bench, inside the VM: fio libaio on /dev/nbdX, rbd-nbd-go vs
# Ceph's own rbd-nbd, on the same image, in the same VM run, alternating
# contenders each round. TCG makes absolute numbers meaningless: read the
# ratios. Also times `map` for both.
#   e2e/bench.sh OUTDIR      (env: BENCH_RUNTIME seconds per job, BENCH_ROUNDS,
#   BENCH_JOBS names to run (default all), BENCH_CONTENDERS (default
#   "ours ours1 ceph direct"; "direct" is fio's rbd engine on the same
#   image: librbd with no NBD hop, the ceiling for any librbd-backed NBD
#   server; "alt" is rbd-nbd-go built from BENCH_ALT_BIN, run with
#   BENCH_ALT_ENV (VAR=VALUE ...) and BENCH_ALT_CLIENT_CONF (lines for
#   a [client] section of its own ceph.conf), for A/B in one run))
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-/vm-out/bench}
mkdir -p "$out"
B=$PWD/bin/rbd-nbd-go
export RBD_NBD_GO_STATE_DIR=/run/rbd-nbd-go
runtime=${BENCH_RUNTIME:-15}
rounds=${BENCH_ROUNDS:-2}
# BENCH_PROFILE=1: a Go CPU profile of the daemon over all its runs.
[ -n "${BENCH_PROFILE:-}" ] && export RBD_NBD_GO_CPU_PROFILE=$out/daemon.pprof
work=$(mktemp -d /tmp/bench.XXXXXX)
export CEPH_CONF
CEPH_CONF=$(scripts/ceph-dev-cluster start "$work/ceph" --timeout 120) || exit 1
ceph-authtool "$work/ceph/keyring" -p -n client.admin > "$work/admin.key" # no slow ceph CLI call
mon=$(awk -F' *= *' '/mon[ _]host/ {print $2; exit}' "$CEPH_CONF")
rbd create --size 1G rbd/bench
# Fill the image once so reads hit real objects.
rbd bench --io-type write --io-size 4M --io-total 1G --io-pattern seq rbd/bench >/dev/null 2>&1

map_ours() { $B --id admin -m "$mon" --keyfile="$work/admin.key" map rbd/bench --try-netlink --io-timeout=0; }
unmap_ours() { $B unmap "$1"; }
# One connection, as rbd-nbd has: separates the transport from the
# multi-queue effect.
map_ours1() { $B --id admin -m "$mon" --keyfile="$work/admin.key" map rbd/bench --try-netlink --io-timeout=0 --connections 1; }
unmap_ours1() { $B unmap "$1"; }
# Ceph's rbd-nbd with the cache off, as safe ceph-csi use needs (see
# shared notes: with the default cache a kill -9 loses acknowledged writes).
map_ceph() { rbd-nbd --id admin -m "$mon" --keyfile="$work/admin.key" --rbd-cache=false map rbd/bench --try-netlink --io-timeout=0; }
unmap_ceph() { rbd-nbd unmap "$1"; sleep 1; }
# Another build of rbd-nbd-go, with its own daemon and state.
{ cat "$CEPH_CONF"; printf '[client]\n%b\n' "${BENCH_ALT_CLIENT_CONF:-}"; } > "$work/alt.conf"
alt() { env RBD_NBD_GO_STATE_DIR=/run/rbd-nbd-go-alt CEPH_CONF="$work/alt.conf" ${BENCH_ALT_ENV:-} "${BENCH_ALT_BIN:?}" "$@"; }
# No device: fio drives librbd itself.
map_direct() { echo librbd; }
unmap_direct() { :; }
map_alt() { alt --id admin -m "$mon" --keyfile="$work/admin.key" map rbd/bench --try-netlink --io-timeout=0; }
unmap_alt() { alt unmap "$1"; }

# nbd.ko, loaded by our daemon (the VM has no modprobe), for a run where
# Ceph's rbd-nbd maps first.
[ -e /dev/nbd0 ] || { d=$($B map mem:4M) && $B unmap "$d"; } || { echo "bench: cannot load nbd"; exit 1; }

jobs="randread-4k-qd32:randread:4k:32 randwrite-4k-qd32:randwrite:4k:32 read-1m-qd8:read:1M:8 write-1m-qd8:write:1M:8"
if [ -n "${BENCH_JOBS:-}" ]; then
	sel=""
	for j in $jobs; do [[ " $BENCH_JOBS " == *" ${j%%:*} "* ]] && sel="$sel $j"; done
	jobs=$sel
fi
contenders=${BENCH_CONTENDERS:-ours ours1 ceph direct}
# CPU of the serving process (ours: the daemon; Ceph's: the pid the
# kernel records for the device), librbd's threads included; none for
# direct, whose librbd runs inside fio.
server_pid() {
	case $1 in
	direct) echo 0 ;;
	ceph) cat /sys/block/nbd0/pid ;;
	alt) cat /run/rbd-nbd-go-alt/daemon.lock ;;
	*) cat /run/rbd-nbd-go/daemon.lock ;;
	esac
}
# fio's own CPU (its job processes included), in seconds, into $1: for
# direct that is all of librbd's work; for a device, the submitting side.
fio_cpu() {
	python3 -c 'import resource, subprocess, sys
rc = subprocess.run(sys.argv[2:]).returncode
u = resource.getrusage(resource.RUSAGE_CHILDREN)
open(sys.argv[1], "w").write("%f" % (u.ru_utime + u.ru_stime))
sys.exit(rc)' "$@"
}
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }
# The serving process's CPU ticks by thread ("tid kind ticks" lines;
# the kind is the name with its number folded: msgr-worker-0..2 are one
# kind), to tell where the CPU per I/O goes: librbd's and librados's
# threads, or the NBD side (our Go threads; rbd-nbd's reader and writer
# threads).
thread_ticks() {
	for t in /proc/"$1"/task/*; do
		n=$(tr ' ' _ < "$t/comm" | sed 's/[-_]*[0-9]*$//')
		v=$(awk '{print $14 + $15}' "$t/stat")
		[ -n "$v" ] && printf '%s %s %s\n' "${t##*/}" "${n:-other}" "$v"
	done 2>/dev/null
}
echo "contender,job,round,iops,bw_kib,map_seconds,cpu_us_per_io,fio_cpu_us_per_io" > "$out/results.csv"
echo "contender,job,round,threads,cpu_us_per_io" > "$out/threads.csv"
for r in $(seq 1 "$rounds"); do
	order=$contenders; [ $((r % 2)) -eq 0 ] && order=$(echo "$contenders" | tr ' ' '\n' | tac | tr '\n' ' ')
	for c in $order; do
		t0=$(date +%s.%N)
		dev=$(map_$c) || { echo "bench: map $c failed"; exit 1; }
		mt=$(echo "$(date +%s.%N) - $t0" | bc)
		echo "bench: round $r $c $dev (map ${mt}s)"
		for j in $jobs; do
			IFS=: read -r name rw bs qd <<<"$j"
			spid=$(server_pid $c); t0=$(cpu_ticks "$spid"); thread_ticks "$spid" > "$work/threads0"
			if [ "$c" = direct ]; then
				target=(--ioengine=rbd --pool=rbd --rbdname=bench --clientname=admin)
			else
				target=(--filename="$dev" --ioengine=libaio --direct=1)
			fi
			fio_cpu "$work/fio.cpu" fio --name="$name" "${target[@]}" --rw="$rw" --bs="$bs" \
				--iodepth="$qd" --size=1G --time_based --runtime="$runtime" --ramp_time=2 \
				--output-format=json > "$work/fio.json" 2>/dev/null
			t1=$(cpu_ticks "$spid"); thread_ticks "$spid" > "$work/threads1"
			python3 - "$work/fio.json" "$c" "$name" "$r" "$mt" "$((t1 - t0))" "$(getconf CLK_TCK)" "$runtime" "$(cat "$work/fio.cpu")" \
				"$work/threads0" "$work/threads1" "$out/threads.csv" >> "$out/results.csv" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]
d = j["read"] if j["read"]["io_bytes"] else j["write"]
ticks, hz, runtime, fio_s = int(sys.argv[6]), int(sys.argv[7]), int(sys.argv[8]), float(sys.argv[9])
# CPU is sampled over ramp + runtime; scale I/O count to the same span.
ios = d["iops"] * (runtime + 2)
cpu = ticks * 1e6 / hz / ios if ios else 0
fcpu = fio_s * 1e6 / ios if ios else 0
print(f"{sys.argv[2]},{sys.argv[3]},{sys.argv[4]},{d['iops']:.0f},{d['bw']},{sys.argv[5]},{cpu:.0f},{fcpu:.0f}")
t0 = {l.split()[0]: int(l.split()[2]) for l in open(sys.argv[10]) if len(l.split()) == 3}
t1 = [l.split() for l in open(sys.argv[11]) if len(l.split()) == 3]
by = {}
for tid, kind, v in t1:
    by[kind] = by.get(kind, 0) + int(v) - t0.get(tid, 0)
# Threads that ended during the job took their ticks with them (the
# process keeps the total): their share is the rest, "(ended)". Our
# readers end their thread when their socket idles (nbd/idle.go).
if t1 and ticks > sum(by.values()):
    by["(ended)"] = ticks - sum(by.values())
with open(sys.argv[12], "a") as f:
    for k in sorted(by):
        if by[k] > 0 and ios:
            f.write(f"{sys.argv[2]},{sys.argv[3]},{sys.argv[4]},{k},{by[k] * 1e6 / hz / ios:.0f}\n")
PY
			tail -1 "$out/results.csv"
		done
		unmap_$c "$dev"
	done
done
python3 - "$out/results.csv" > "$out/summary.txt" <<'PY'
import csv, sys, statistics as st
rows = list(csv.DictReader(open(sys.argv[1])))
names = {"ours": "rbd-nbd-go", "ours1": "1 conn", "alt": "alt build", "ceph": "rbd-nbd", "direct": "librbd direct"}
seen = lambda k: list(dict.fromkeys(r[k] for r in rows))
jobs, cs = seen("job"), [c for c in names if c in seen("contender")]
val = {"iops": lambda r: float(r["iops"]), "server": lambda r: float(r["cpu_us_per_io"]),
       "total": lambda r: float(r["cpu_us_per_io"]) + float(r["fio_cpu_us_per_io"])}
med = lambda job, c, k: st.median(val[k](r) for r in rows if r["job"] == job and r["contender"] == c)
def table(k, title, unit, skip=()):
    print(f"{title}, median of {len(seen('round'))} rounds (ratio to rbd-nbd)")
    print(f"{'job':<18}" + "".join(f"{names[c]:>20}" for c in cs))
    for job in jobs:
        b = med(job, "ceph", k) if "ceph" in cs else 0
        cell = lambda c: "-" if c in skip else f"{med(job, c, k):.0f}{unit}" + (f" ({med(job, c, k) / b:.2f}x)" if b else "")
        print(f"{job:<18}" + "".join(f"{cell(c):>20}" for c in cs))
    print()
table("iops", "IOPS", "")
table("server", "serving process CPU per I/O (librbd's threads included)", "us", skip=("direct",))
table("total", "serving process + fio CPU per I/O (direct: fio, which runs librbd)", "us")
print("map time (median): " + ", ".join(f"{names[c]} {st.median(float(r['map_seconds']) for r in rows if r['contender'] == c):.2f}s" for c in cs if c != "direct"))
# Where the serving process's CPU goes, by kind of thread; a kind absent
# from a round (no tick) counts as 0 there.
th = list(csv.DictReader(open(sys.argv[1].replace("results.csv", "threads.csv"))))
for job in jobs:
    print(f"\n{job}: serving process CPU per I/O by thread, us, median of rounds")
    kinds = sorted(set(t["threads"] for t in th if t["job"] == job))
    tc = [c for c in cs if c != "direct"]
    print(f"{'threads':<18}" + "".join(f"{names[c]:>14}" for c in tc))
    for k in kinds:
        cell = []
        for c in tc:
            rs = [r["round"] for r in rows if r["job"] == job and r["contender"] == c]
            v = [sum(float(t["cpu_us_per_io"]) for t in th if t["job"] == job and t["contender"] == c
                     and t["round"] == r and t["threads"] == k) for r in rs]
            cell.append(f"{st.median(v):.0f}" if v and max(v) > 0 else "-")
        print(f"{k:<18}" + "".join(f"{x:>14}" for x in cell))
PY
cat "$out/summary.txt"
pkill -f "$B daemon"; [ -n "${BENCH_ALT_BIN:-}" ] && pkill -f "$BENCH_ALT_BIN daemon"; sleep 2
scripts/ceph-dev-cluster stop "$work/ceph" >/dev/null 2>&1
