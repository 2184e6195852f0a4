#!/bin/bash
# In the VM: ours (bin/rbd-nbd-go) vs alt (ALT, run under ALT_ENV, e.g.
# "env RBD_NBD_GO_SYSMON_SLACK=4ms") vs rbd-nbd, 4k QD32: CPU per I/O
# (ticks), and per thread (perf stat --per-thread) syscalls, context
# switches and CPU, with sysmon found as the Go thread most often seen
# in nanosleep. perf's per-thread counting itself costs CPU on every
# context switch: compare contenders within a run, not with e2e/bench.sh.
#   scripts/vm/vm.sh --share OUT -- perthread.sh OUT; analyze.py OUT
set -uo pipefail
cd "$(dirname "$0")/../../../.."
out=$1; mkdir -p "$out"
B=$PWD/bin/rbd-nbd-go
ALT=${ALT:?another build, or the same with ALT_ENV}
ROUNDS=${ROUNDS:-3}
work=$(mktemp -d /tmp/prof.XXXXXX)
export CEPH_CONF
CEPH_CONF=$(scripts/ceph-dev-cluster start "$work/ceph" --timeout 120) || exit 1
ceph-authtool "$work/ceph/keyring" -p -n client.admin > "$work/admin.key"
mon=$(awk -F' *= *' '/mon[ _]host/ {print $2; exit}' "$CEPH_CONF")
rbd create --size 1G rbd/bench
rbd bench --io-type write --io-size 4M --io-total 1G --io-pattern seq rbd/bench >/dev/null 2>&1
mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null
export RBD_NBD_GO_STATE_DIR=/run/rbd-nbd-go
[ -e /dev/nbd0 ] || { d=$($B map mem:4M) && $B unmap "$d"; }
map_ours() { RBD_NBD_GO_STATE_DIR=/run/rbd-nbd-go $B --id admin -m "$mon" --keyfile="$work/admin.key" map rbd/bench --try-netlink --io-timeout=0; }
map_alt() { RBD_NBD_GO_STATE_DIR=/run/rbd-nbd-go-alt ${ALT_ENV:-} $ALT --id admin -m "$mon" --keyfile="$work/admin.key" map rbd/bench --try-netlink --io-timeout=0; }
map_ceph() { rbd-nbd --id admin -m "$mon" --keyfile="$work/admin.key" --rbd-cache=false map rbd/bench --try-netlink --io-timeout=0; }
pid_ours() { cat /run/rbd-nbd-go/daemon.lock; }
pid_alt() { cat /run/rbd-nbd-go-alt/daemon.lock; }
pid_ceph() { cat /sys/block/nbd0/pid; }
unmap_ours() { RBD_NBD_GO_STATE_DIR=/run/rbd-nbd-go $B unmap $1; }
unmap_alt() { RBD_NBD_GO_STATE_DIR=/run/rbd-nbd-go-alt ${ALT_ENV:-} $ALT unmap $1; }
unmap_ceph() { rbd-nbd unmap $1; sleep 1; }
echo "contender,job,round,iops,cpu_us_per_io,sysmon_wakeups_per_io,sysmon_us_per_io,go_us_per_io" > $out/results.csv
for round in $(seq 1 $ROUNDS); do
order="ours alt ceph"; [ $((round % 2)) -eq 0 ] && order="ceph alt ours"
for c in $order; do
	dev=$(map_$c); pid=$(pid_$c)
	for rw in randwrite randread; do
		fio --name=w --filename=$dev --ioengine=libaio --direct=1 --rw=$rw --bs=4k --iodepth=32 --time_based --runtime=2 >/dev/null 2>&1
		read -r u0 s0 < <(awk '{print $14, $15}' /proc/$pid/stat)
		perf stat -x, --per-thread -e context-switches,raw_syscalls:sys_enter,task-clock -p $pid -o $out/$c-$rw-$round.stat -- sleep 12 &
		sp=$!
		( sleep 5; for i in 1 2 3 4 5 6 7 8 9 10; do for t in /proc/$pid/task/*; do echo "${t##*/} $(cut -d' ' -f1 $t/syscall 2>/dev/null)"; done; sleep 0.2; done > $work/sc ) &
		fio --name=w --filename=$dev --ioengine=libaio --direct=1 --rw=$rw --bs=4k --iodepth=32 --time_based --runtime=12 --output-format=json > $work/fio.json 2>/dev/null
		wait
		read -r u1 s1 < <(awk '{print $14, $15}' /proc/$pid/stat)
		cp $work/sc $out/$c-$rw-$round.sc
		python3 - $out/$c-$rw-$round.stat $work/fio.json $c $rw $round $((u1+s1-u0-s0)) $work/sc <<'PY' | tee -a $out/summary.txt
import sys, json, collections
stat, fj, c, rw, rnd, ticks, scf = sys.argv[1:8]
j=json.load(open(fj))["jobs"][0]; d=j["read"] if j["read"]["io_bytes"] else j["write"]
iops=d["iops"]; ios=iops*12
th=collections.defaultdict(dict)
for l in open(stat):
    f=l.strip().split(',')
    if len(f)<4 or '-' not in f[0]: continue
    try: v=float(f[1])
    except ValueError: continue
    th[f[0]][f[3]]=v
# sysmon: the Go thread seen most often in nanosleep (35)
ns=collections.Counter(l.split()[0] for l in open(scf) if l.split()[1:]==['35'])
sysmon=None
if ns:
    tid=ns.most_common(1)[0][0]
    for k in th:
        if k.endswith('-'+tid): sysmon=k
cpu=int(ticks)*1e4/ios
go=sum(v.get('task-clock',0) for k,v in th.items() if k.startswith('rbd-nbd-go') or k.startswith('rbd_reader') or k.startswith('rbd_writer'))/1e3/ios
sm=th.get(sysmon,{})
print(f"{c},{rw},{rnd},{iops:.0f},{cpu:.0f},{sm.get('context-switches',0)/ios:.2f},{sm.get('task-clock',0)/1e3/ios:.1f},{go:.0f}")
rows=sorted(th.items(), key=lambda kv:-kv[1].get('task-clock',0))[:8]
for k,v in rows:
    print(f"#  {k:24s}{' (sysmon)' if k==sysmon else '':9s} cpu/io={v.get('task-clock',0)/1e3/ios:6.1f}us sys/io={v.get('raw_syscalls:sys_enter',0)/ios:5.2f} csw/io={v.get('context-switches',0)/ios:5.2f}")
PY
	done
	unmap_$c $dev
done
done
grep -v '^#' $out/summary.txt >> $out/results.csv
pkill -f "$B daemon"; pkill -f "$ALT daemon"
