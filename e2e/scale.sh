#!/bin/bash
# Node-scale bench, inside the VM: N images mapped at once, 4 MiB written
# to each, then all unmapped; for each contender the serving processes'
# memory (Pss, Rss summed), threads, map and unmap times, and (ours) the
# daemon's memory a minute after the last unmap against its start-up.
#   e2e/scale.sh OUTDIR     (env: BENCH_SCALE_N "8 32", BENCH_SCALE_CONTENDERS
#   "ours ours16 ceph": rbd-nbd-go with the default connections (one per
#   vCPU) and with 16, and Ceph's rbd-nbd; "alt" and "alt16" are the same
#   for the build in BENCH_ALT_BIN, for A/B in one run; BENCH_SCALE_AFTER
#   seconds to wait after the last unmap (60); BENCH_SCALE_KEEP_TRACE=1 keeps
#   the nbd trace of every run, not only of one with a kernel timeout;
#   BENCH_SCALE_DUMP=1 ends each daemon of ours with SIGQUIT, so its log
#   ends with every goroutine's stack)
. "$(dirname "$0")/lib.sh" # B, work, and cluster(): CEPH_CONF, $mon, $work/admin.key
out=${1:-/vm-out/scale}
mkdir -p "$out"
cluster || exit 1
ns=${BENCH_SCALE_N:-8 32}
maxn=0
for n in $ns; do ((n > maxn)) && maxn=$n; done
for i in $(seq 1 $maxn); do rbd create --size 64M rbd/s$i || exit 1; done

k=(--id admin -m "$mon" --keyfile="$work/admin.key")
state() { # the state dir and binary of a contender of ours
	case $1 in
	alt*) echo "/run/rbd-nbd-go-$1 ${BENCH_ALT_BIN:?}" ;;
	*) echo "/run/rbd-nbd-go-$1 $B" ;;
	esac
}
map_one() { # map_one CONTENDER IMAGE -> device
	local st bin conns=()
	[ "$1" = ceph ] && { rbd-nbd "${k[@]}" --rbd-cache=false map "rbd/$2" --try-netlink --io-timeout=0; return; }
	read -r st bin <<<"$(state "$1")"
	[[ $1 == *16 ]] && conns=(--connections 16)
	RBD_NBD_GO_STATE_DIR=$st $bin "${k[@]}" map "rbd/$2" --try-netlink --io-timeout=0 "${conns[@]}"
}
unmap_one() {
	local st bin
	case $1 in
	ceph) rbd-nbd unmap "$2" ;;
	*) read -r st bin <<<"$(state "$1")"; RBD_NBD_GO_STATE_DIR=$st $bin unmap "$2" ;;
	esac
}
pids() { # the serving processes
	case $1 in
	ceph) pgrep -x rbd-nbd ;;
	*) local st; read -r st _ <<<"$(state "$1")"; cat "$st/daemon.lock" 2>/dev/null ;;
	esac
}
mem() { # mem CONTENDER -> "pss_kib rss_kib threads procs"
	local p pss=0 rss=0 thr=0 n=0 a b
	for p in $(pids "$1"); do
		a=$(awk '/^Pss:/ {print $2}' /proc/$p/smaps_rollup 2>/dev/null) || continue
		b=$(awk '/^Rss:/ {print $2}' /proc/$p/smaps_rollup 2>/dev/null)
		pss=$((pss + ${a:-0})) rss=$((rss + ${b:-0}))
		thr=$((thr + $(awk '/^Threads:/ {print $2}' /proc/$p/status)))
		n=$((n + 1))
	done
	echo "$pss $rss $thr $n"
}
diag() { # where one contender's memory and threads go (its first process)
	local p
	p=$(pids "$1" | head -1)
	[ -n "$p" ] || return
	grep -E '^(Rss|Pss|Pss_Anon|Pss_File|Pss_Shmem|Locked|AnonHugePages|LazyFree):' /proc/$p/smaps_rollup
	grep THP_enabled /proc/$p/status
	echo "threads by name:"
	cat /proc/$p/task/*/comm | sort | uniq -c | sort -rn
	echo "threads by name, system call number and wait channel (running if none):"
	for t in /proc/$p/task/*; do
		echo "$(cat $t/comm) $(cut -d' ' -f1 $t/syscall 2>/dev/null) $(cat $t/wchan 2>/dev/null)"
	done | sort | uniq -c | sort -rn
	echo "largest mappings by Pss (KiB):"
	awk '/^[0-9a-f]+-[0-9a-f]+ / {name = $6 ? $6 : "[anon]"} /^Pss:/ {pss[name] += $2} END {for (n in pss) print pss[n], n}' /proc/$p/smaps | sort -rn | head -15
	echo "anonymous mappings with Pss >= 128 KiB (start, size KiB, Pss KiB):"
	awk '/^[0-9a-f]+-[0-9a-f]+ / {anon = !$6; a = $1} /^Size:/ {sz = $2} /^Pss:/ && anon && $2 >= 128 {print a, sz, $2}' /proc/$p/smaps
	echo "the daemon's last memory release:"
	grep "memory given back" "$(state "$1" | cut -d' ' -f1)/daemon.log" 2>/dev/null | tail -1
}
ms() { echo $((($(date +%s%N) - $1) / 1000000)); }
stats() { sort -n | awk '{a[NR] = $1} END {printf "%d %d", a[int((NR + 1) / 2)], a[NR]}'; } # median max

# nbd.ko, loaded by our daemon (the VM has no modprobe), with room for
# every device of the biggest run.
{ d=$($B map mem:4M) && $B unmap "$d"; pkill -f "$B daemon"; sleep 1; } || { echo "scale: cannot load nbd"; exit 1; }

# The nbd driver's tracepoints (request sent, reply header received),
# kept per contender when the kernel timed a request out: they tell a
# reply that came late from one that came and was not read.
tr=/sys/kernel/tracing
{ [ -d $tr/events ] || mount -t tracefs nodev $tr; } 2>/dev/null
if [ -d $tr/events/nbd ]; then
	echo 8192 >$tr/buffer_size_kb
	echo 1 >$tr/events/nbd/enable
	echo "scale: tracing the nbd driver's events"
else
	tr=
	echo "scale: no nbd tracepoints: a timeout will have only dmesg"
fi

printf '| N | contender | Pss MiB | Rss MiB | threads | procs | map ms (median/max) | unmap ms (median/max) | start-up Pss MiB | Pss MiB %ss after unmap | threads after |\n' "${BENCH_SCALE_AFTER:-60}" >"$out/scale.md"
printf '|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n' >>"$out/scale.md"
for n in $ns; do
	for c in ${BENCH_SCALE_CONTENDERS:-ours ours16 ceph}; do
		echo "scale: N=$n $c"
		start="-"
		if [ "$c" != ceph ]; then
			# The daemon started and idle: one tiny device mapped and
			# unmapped, so it runs, with no Ceph client yet.
			d=$(map_one "$c" s1) && unmap_one "$c" "$d" >/dev/null
			sleep 2
			read -r p _ _ _ <<<"$(mem "$c")"
			start=$((p / 1024))
			diag "$c" >"$out/diag-start-$n-$c.txt"
		fi
		dmesg -C
		[ -n "$tr" ] && : >$tr/trace
		: >"$work/map.ms"; : >"$work/unmap.ms"; devs=()
		for i in $(seq 1 "$n"); do
			t0=$(date +%s%N)
			d=$(map_one "$c" s$i) || { echo "scale: map s$i failed"; break; }
			ms "$t0" >>"$work/map.ms"
			devs+=("$d")
			dd if=/dev/urandom of="$d" bs=1M count=4 oflag=direct status=none
		done
		sleep 3
		read -r pss rss thr procs <<<"$(mem "$c")"
		diag "$c" >"$out/diag-$n-$c.txt"
		for d in "${devs[@]}"; do
			t0=$(date +%s%N)
			unmap_one "$c" "$d" >/dev/null || echo "scale: unmap $d failed"
			ms "$t0" >>"$work/unmap.ms"
		done
		after="-" athr="-"
		if [ "$c" != ceph ]; then
			sleep "${BENCH_SCALE_AFTER:-60}"
			read -r p _ athr _ <<<"$(mem "$c")"
			after=$((p / 1024))
			diag "$c" >"$out/diag-after-$n-$c.txt"
			# Where a request waited, if one was slow (the daemon's watchdog).
			grep -E "slow request|not read" "$(state "$c" | cut -d' ' -f1)/daemon.log" >"$out/slow-$n-$c.txt" 2>/dev/null
			# Every goroutine's stack into the log (SIGQUIT ends the daemon).
			[ "${BENCH_SCALE_DUMP:-0}" = 1 ] && { kill -QUIT "$(pids "$c")"; sleep 2; }
			cp "$(state "$c" | cut -d' ' -f1)/daemon.log" "$out/daemon-$n-$c.log" 2>/dev/null
			pkill -f "daemon --state-dir $(state "$c" | cut -d' ' -f1)( |$)"
			sleep 1
		fi
		read -r mmed mmax <<<"$(stats <"$work/map.ms")"
		read -r umed umax <<<"$(stats <"$work/unmap.ms")"
		printf '| %d | %s | %d | %d | %d | %d | %d / %d | %d / %d | %s | %s | %s |\n' "$n" "$c" $((pss / 1024)) $((rss / 1024)) \
			"$thr" "$procs" "$mmed" "$mmax" "$umed" "$umax" "$start" "$after" "$athr" | tee -a "$out/scale.md"
		cp "$work/unmap.ms" "$out/unmap-$n-$c.ms"
		# All of it: a timeout's neighbours ("Receive control failed",
		# "Unexpected reply") say what the kernel did next.
		dmesg >"$out/dmesg-$n-$c.txt"
		if [ -n "$tr" ] && { grep -q "timed out" "$out/dmesg-$n-$c.txt" || [ "${BENCH_SCALE_KEEP_TRACE:-}" = 1 ]; }; then
			cp $tr/trace "$out/trace-$n-$c.txt"
		fi
	done
done
[ -n "$tr" ] && echo 0 >$tr/events/nbd/enable
scripts/ceph-dev-cluster stop "$work/ceph" >/dev/null 2>&1
# The chart (e2e/scale_chart.py; run it alone to draw a kept run again).
python3 e2e/scale_chart.py "$out" >"$out/scale.svg"
cat "$out/scale.md"
