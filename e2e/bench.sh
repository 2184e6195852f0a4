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
#   a [client] section of its own ceph.conf), for A/B in one run;
#   "ours-luks" is rbd-nbd-go on a second image formatted LUKS2 by librbd,
#   opened with librbd's encryption; "ceph-dmcrypt" is ceph-csi's encrypted
#   path: Ceph's rbd-nbd on a third image, LUKS2-formatted by cryptsetup on
#   the mapped device and opened with dm-crypt, as ceph-csi does),
#   BENCH_CRYPT_JOBS the jobs the two encrypted contenders run (default
#   the 4k ones))
# CPU per I/O is counted three ways, all over the same fio run: the
# serving process alone; "node", the serving process plus the kernel's
# worker and softirq threads and dm-crypt's threads (so kcryptd's work
# counts, and the NBD driver's); and node plus fio.
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

contenders=${BENCH_CONTENDERS:-ours ours1 ceph direct ours-luks ceph-dmcrypt}
crypt_jobs=${BENCH_CRYPT_JOBS:-randread-4k-qd32 randwrite-4k-qd32}
# The encrypted images: 1G of data behind a LUKS2 header (16 MiB at most,
# librbd's and cryptsetup's), one passphrase for both.
printf %s "bench-luks-$RANDOM$RANDOM" > "$work/luks.pass"
luks_size=$((1024 + 16))M
export DM_DISABLE_UDEV=1 # the VM has no udev: libdevmapper makes /dev/mapper nodes itself

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
# librbd's LUKS2 in our daemon: same options as ours.
map_ours_luks() { $B --id admin -m "$mon" --keyfile="$work/admin.key" map rbd/bench-luks --try-netlink --io-timeout=0 \
	--encryption-format luks2 --encryption-passphrase-file "$work/luks.pass"; }
unmap_ours_luks() { $B unmap "$1"; }
# ceph-csi's path: rbd-nbd as "ceph", then cryptsetup luksOpen with
# ceph-csi's arguments (internal/util/cryptsetup: --disable-keyring,
# passphrase on stdin; no dm-crypt performance flags). The nbd device
# under the mapping is kept in $work/dmcrypt.nbd.
map_ceph_dmcrypt() {
	local nbd
	nbd=$(rbd-nbd --id admin -m "$mon" --keyfile="$work/admin.key" --rbd-cache=false map rbd/bench-dmcrypt --try-netlink --io-timeout=0) || return 1
	echo "$nbd" > "$work/dmcrypt.nbd"
	cryptsetup luksOpen "$nbd" bench-dmcrypt --disable-keyring -d - < "$work/luks.pass" >&2 || { rbd-nbd unmap "$nbd"; return 1; }
	echo /dev/mapper/bench-dmcrypt
}
unmap_ceph_dmcrypt() { cryptsetup luksClose bench-dmcrypt; rbd-nbd unmap "$(cat "$work/dmcrypt.nbd")"; sleep 1; }
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

# Each encrypted image is formatted once and filled once through its
# decrypted device, like the plain one, so reads hit real objects and
# decrypt real ciphertext.
fill() { fio --name=fill --filename="$1" --rw=write --bs=4M --iodepth=8 --ioengine=libaio --direct=1 >/dev/null 2>&1; }
if [[ " $contenders " == *" ours-luks "* ]]; then
	rbd create --size "$luks_size" rbd/bench-luks &&
		rbd encryption format rbd/bench-luks luks2 "$work/luks.pass" &&
		d=$(map_ours_luks) && fill "$d" && echo "bench: ours-luks $d: $(blockdev --getsize64 "$d") bytes" &&
		unmap_ours_luks "$d" || { echo "bench: cannot set up ours-luks"; exit 1; }
fi
if [[ " $contenders " == *" ceph-dmcrypt "* ]]; then
	rbd create --size "$luks_size" rbd/bench-dmcrypt &&
		nbd=$(rbd-nbd --id admin -m "$mon" --keyfile="$work/admin.key" --rbd-cache=false map rbd/bench-dmcrypt --try-netlink --io-timeout=0) &&
		cryptsetup -q luksFormat --type luks2 --hash sha256 --pbkdf-memory 32768 "$nbd" -d - < "$work/luks.pass" &&
		cryptsetup luksDump "$nbd" | grep -E '^Version|cipher|sector|offset|PBKDF' | sed 's/^/bench: ceph-dmcrypt luks2: /' &&
		rbd-nbd unmap "$nbd" && sleep 1 &&
		d=$(map_ceph_dmcrypt) && fill "$d" && echo "bench: ceph-dmcrypt $d: $(blockdev --getsize64 "$d") bytes" &&
		unmap_ceph_dmcrypt "$d" || { echo "bench: cannot set up ceph-dmcrypt"; exit 1; }
fi
grep -E '^name +: (xts|__xts)' -A3 /proc/crypto | grep -E '^(name|driver)' | sed 's/^/bench: crypto: /'

jobs="randread-4k-qd32:randread:4k:32 randwrite-4k-qd32:randwrite:4k:32 read-1m-qd8:read:1M:8 write-1m-qd8:write:1M:8"
if [ -n "${BENCH_JOBS:-}" ]; then
	sel=""
	for j in $jobs; do [[ " $BENCH_JOBS " == *" ${j%%:*} "* ]] && sel="$sel $j"; done
	jobs=$sel
fi
# CPU of the serving process (ours: the daemon; Ceph's: the pid the
# kernel records for the device), librbd's threads included; none for
# direct, whose librbd runs inside fio.
server_pid() {
	case $1 in
	direct) echo 0 ;;
	ceph) cat "/sys/block/${2#/dev/}/pid" ;;
	ceph-dmcrypt) cat "/sys/block/$(basename "$(cat "$work/dmcrypt.nbd")")/pid" ;;
	alt) cat /run/rbd-nbd-go-alt/daemon.lock ;;
	*) cat /run/rbd-nbd-go/daemon.lock ;;
	esac
}
# fio's own CPU (its job processes included), in seconds, into $1: for
# direct that is all of librbd's work; for a device, the submitting side.
# Into $2, the VM's busy CPU over fio's life (/proc/stat: user, nice,
# system, irq, softirq, steal, all CPUs; ticks) and every process's
# utime+stime over it ("pid": [comm, ticks]; kernel threads included,
# the whole of a process that started meanwhile; those that ended took
# theirs with them), for the "node" CPU per I/O.
fio_cpu() {
	python3 -c 'import json, os, resource, subprocess, sys
def snap():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    procs = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            s = open("/proc/%s/stat" % p).read()
        except OSError:
            continue
        f = s[s.rindex(")") + 2:].split()
        procs[p] = (s[s.index("(") + 1:s.rindex(")")], int(f[11]) + int(f[12]))
    return v[0] + v[1] + v[2] + v[5] + v[6] + v[7], procs
b0, p0 = snap()
rc = subprocess.run(sys.argv[3:]).returncode
b1, p1 = snap()
u = resource.getrusage(resource.RUSAGE_CHILDREN)
open(sys.argv[1], "w").write("%f" % (u.ru_utime + u.ru_stime))
# By pid alone: a kworker changes its name to the workqueue it last served.
d = {p: (c, t - p0[p][1] if p in p0 and t >= p0[p][1] else t) for p, (c, t) in p1.items()}
json.dump({"busy": b1 - b0, "procs": d}, open(sys.argv[2], "w"))
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
echo "contender,job,round,iops,bw_kib,map_seconds,cpu_us_per_io,fio_cpu_us_per_io,node_cpu_us_per_io,cluster_cpu_us_per_io" > "$out/results.csv"
echo "contender,job,round,threads,cpu_us_per_io" > "$out/threads.csv"
echo "contender,job,round,part,cpu_us_per_io" > "$out/node.csv"
for r in $(seq 1 "$rounds"); do
	order=$contenders; [ $((r % 2)) -eq 0 ] && order=$(echo "$contenders" | tr ' ' '\n' | tac | tr '\n' ' ')
	for c in $order; do
		t0=$(date +%s.%N)
		dev=$(map_${c//-/_}) || { echo "bench: map $c failed"; exit 1; }
		mt=$(echo "$(date +%s.%N) - $t0" | bc)
		echo "bench: round $r $c $dev (map ${mt}s)"
		cjobs=$jobs
		case $c in ours-luks | ceph-dmcrypt)
			cjobs=""
			for j in $jobs; do [[ " $crypt_jobs " == *" ${j%%:*} "* ]] && cjobs="$cjobs $j"; done ;;
		esac
		for j in $cjobs; do
			IFS=: read -r name rw bs qd <<<"$j"
			spid=$(server_pid $c "$dev"); t0=$(cpu_ticks "$spid"); thread_ticks "$spid" > "$work/threads0"
			if [ "$c" = direct ]; then
				target=(--ioengine=rbd --pool=rbd --rbdname=bench --clientname=admin)
			else
				target=(--filename="$dev" --ioengine=libaio --direct=1)
			fi
			fio_cpu "$work/fio.cpu" "$work/node.json" fio --name="$name" "${target[@]}" --rw="$rw" --bs="$bs" \
				--iodepth="$qd" --size=1G --time_based --runtime="$runtime" --ramp_time=2 \
				--output-format=json > "$work/fio.json" 2>/dev/null
			t1=$(cpu_ticks "$spid"); thread_ticks "$spid" > "$work/threads1"
			python3 - "$work/fio.json" "$c" "$name" "$r" "$mt" "$((t1 - t0))" "$(getconf CLK_TCK)" "$runtime" "$(cat "$work/fio.cpu")" \
				"$work/threads0" "$work/threads1" "$out/threads.csv" "$work/node.json" "$spid" "$out/node.csv" >> "$out/results.csv" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]
d = j["read"] if j["read"]["io_bytes"] else j["write"]
ticks, hz, runtime, fio_s = int(sys.argv[6]), int(sys.argv[7]), int(sys.argv[8]), float(sys.argv[9])
# CPU is sampled over ramp + runtime; scale I/O count to the same span.
ios = d["iops"] * (runtime + 2)
cpu = ticks * 1e6 / hz / ios if ios else 0
fcpu = fio_s * 1e6 / ios if ios else 0
# Node CPU: the CPU of every process and kernel thread over fio's life
# but fio's own and the Ceph cluster's daemons' (the OSD and monitor
# stand in for remote machines), by where it went: the serving process,
# kernel workers (kcryptd's work and the NBD driver's receive work run
# in kworkers), dm-crypt's own threads, softirq threads. Shown, not
# counted: "other processes" (this script, the other contenders' idle
# daemon, other kernel threads) and "(unattributed)", /proc/stat's busy
# total less all processes. Per process, not that total: under TCG the
# VM loses ticks, and the total came out below the serving process's
# own CPU (which the kernel takes from the scheduler's runtime).
n = json.load(open(sys.argv[13]))
part = {}
for pid, (comm, t) in n["procs"].items():
    if pid == sys.argv[14]:
        k = "server"
    elif comm in ("ceph-mon", "ceph-osd", "ceph-mgr"):
        k = "(cluster)"
    elif comm.startswith("kworker/"):
        k = "kworkers"
    elif comm.startswith(("kcryptd", "dmcrypt_write")):
        k = "dm-crypt threads"
    elif comm.startswith("ksoftirqd"):
        k = "ksoftirqd"
    else:
        k = "other processes"
    part[k] = part.get(k, 0) + t
fio_t = fio_s * hz
cluster = part.pop("(cluster)", 0)
node = sum(v for k, v in part.items() if k != "other processes")
part["(unattributed)"] = n["busy"] - fio_t - cluster - sum(part.values())
us = lambda t: t * 1e6 / hz / ios if ios else 0
print(f"{sys.argv[2]},{sys.argv[3]},{sys.argv[4]},{d['iops']:.0f},{d['bw']},{sys.argv[5]},{cpu:.0f},{fcpu:.0f},{us(node):.0f},{us(cluster):.0f}")
with open(sys.argv[15], "a") as f:
    for k in sorted(part):
        f.write(f"{sys.argv[2]},{sys.argv[3]},{sys.argv[4]},{k},{us(part[k]):.0f}\n")
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
		unmap_${c//-/_} "$dev"
	done
done
python3 - "$out/results.csv" > "$out/summary.txt" <<'PY'
import csv, sys, statistics as st
rows = list(csv.DictReader(open(sys.argv[1])))
names = {"ours": "rbd-nbd-go", "ours1": "1 conn", "alt": "alt build", "ceph": "rbd-nbd", "direct": "librbd direct",
         "ours-luks": "rbd-nbd-go LUKS2", "ceph-dmcrypt": "rbd-nbd+dm-crypt"}
seen = lambda k: list(dict.fromkeys(r[k] for r in rows))
jobs, cs = seen("job"), [c for c in names if c in seen("contender")]
val = {"iops": lambda r: float(r["iops"]), "server": lambda r: float(r["cpu_us_per_io"]),
       "total": lambda r: float(r["cpu_us_per_io"]) + float(r["fio_cpu_us_per_io"]),
       "node": lambda r: float(r["node_cpu_us_per_io"]),
       "nodefio": lambda r: float(r["node_cpu_us_per_io"]) + float(r["fio_cpu_us_per_io"])}
def med(job, c, k):
    v = [val[k](r) for r in rows if r["job"] == job and r["contender"] == c]
    return st.median(v) if v else None
def table(k, title, unit, skip=()):
    print(f"{title}, median of {len(seen('round'))} rounds (ratio to rbd-nbd)")
    print(f"{'job':<18}" + "".join(f"{names[c]:>20}" for c in cs))
    for job in jobs:
        b = med(job, "ceph", k) if "ceph" in cs else 0
        def cell(c):
            m = med(job, c, k)
            if c in skip or m is None:
                return "-"
            return f"{m:.0f}{unit}" + (f" ({m / b:.2f}x)" if b else "")
        print(f"{job:<18}" + "".join(f"{cell(c):>20}" for c in cs))
    print()
table("iops", "IOPS", "")
table("server", "serving process CPU per I/O (librbd's threads included)", "us", skip=("direct",))
table("total", "serving process + fio CPU per I/O (direct: fio, which runs librbd)", "us")
table("node", "node CPU per I/O: serving process + kworkers, ksoftirqd, dm-crypt threads", "us")
table("nodefio", "node CPU per I/O with fio's", "us")
print("map time (median): " + ", ".join(f"{names[c]} {st.median(float(r['map_seconds']) for r in rows if r['contender'] == c):.2f}s" for c in cs if c != "direct"))
# Encryption: librbd's LUKS2 in our daemon against our plain volume and
# against ceph-csi's dm-crypt over rbd-nbd.
pairs = [(a, b) for a, b in (("ours-luks", "ours"), ("ours-luks", "ceph-dmcrypt"), ("ceph-dmcrypt", "ceph")) if a in cs and b in cs]
if pairs:
    print("\nencryption ratios (medians; CPU per I/O: lower is better)")
    print(f"{'job':<18}{'ratio':<28}{'IOPS':>8}{'server':>8}{'node':>8}{'node+fio':>10}")
    for job in jobs:
        for a, b in pairs:
            r = [med(job, a, k) / med(job, b, k) if med(job, a, k) is not None and med(job, b, k) else None
                 for k in ("iops", "server", "node", "nodefio")]
            if r[0] is None:
                continue
            print(f"{job:<18}{a + ' / ' + b:<28}" + "".join(f"{x:>{w}.2f}x" for x, w in zip(r, (7, 7, 7, 9))))
# Where the serving process's CPU goes, by kind of thread; a kind absent
# from a round (no tick) counts as 0 there.
def parts(csvname, key, title, tc):
    th = list(csv.DictReader(open(sys.argv[1].replace("results.csv", csvname))))
    for job in jobs:
        print(f"\n{job}: {title}, us, median of rounds")
        kinds = sorted(set(t[key] for t in th if t["job"] == job))
        print(f"{key:<18}" + "".join(f"{names[c]:>18}" for c in tc))
        for k in kinds:
            cell = []
            for c in tc:
                rs = [r["round"] for r in rows if r["job"] == job and r["contender"] == c]
                v = [sum(float(t["cpu_us_per_io"]) for t in th if t["job"] == job and t["contender"] == c
                         and t["round"] == r and t[key] == k) for r in rs]
                cell.append(f"{st.median(v):.0f}" if v and max(v) != 0 else "-")
            print(f"{k:<18}" + "".join(f"{x:>18}" for x in cell))
parts("threads.csv", "threads", "serving process CPU per I/O by thread", [c for c in cs if c != "direct"])
parts("node.csv", "part", "node CPU per I/O by part ((unattributed) and other processes: not in node)", cs)
PY
cat "$out/summary.txt"
[ -e /dev/mapper/bench-dmcrypt ] && cryptsetup luksClose bench-dmcrypt
pkill -f "$B daemon"; [ -n "${BENCH_ALT_BIN:-}" ] && pkill -f "$BENCH_ALT_BIN daemon"; sleep 2
scripts/ceph-dev-cluster stop "$work/ceph" >/dev/null 2>&1
