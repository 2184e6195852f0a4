#!/bin/bash
# Restart bench, inside the VM: what an upgrade and a kill -9 of the node
# daemon cost the I/O of its devices, beside rounds with no event at all
# (the machine's own floor, measured in the same run) and beside Ceph's
# rbd-nbd restarted the way ceph-csi restarts it. The chaos soak measures
# the same events on a loaded box, where a floor of 2-8 s hides what a
# sub-second handover costs; here the load is light and steady, so the
# floor stays well under a second and the event's own stall shows.
#   e2e/restart.sh OUTDIR   (env: BENCH_RESTART_DEVICES (8),
#   BENCH_RESTART_ROUNDS rounds of each of ours (5), BENCH_RESTART_PEER=0
#   leaves out Ceph's rbd-nbd (one round each, a minute apiece))
# Every round: each device mapped as the CSI driver maps it (one
# connection, NBD timeout 0, 2 s resend interval) takes fio 4k randwrite
# at QD4, 50 IOPS, each block read back and checked (crc32c) 16 writes
# later (--verify_backlog: a time-based run has no verify phase after
# it); the event comes 8 s in. A round's stall is the slowest write of
# any device (fio's maximum total latency, submission to completion).
# Events:
#   none      nothing: the floor
#   handover  a new daemon started with --take-over (what the CSI node
#             plugin of an upgrade's new pod starts): the old one pauses,
#             hands its sockets over and exits
#   kill      kill -9 of the daemon; once it is gone (the CSI plugin's
#             supervisor starts its child again the moment it exits)
#             ceph-csi's attach of one device starts a daemon, which
#             takes every device back
#   ceph-kill, ceph-term  Ceph's rbd-nbd, mapped with ceph-csi's options:
#             kill -9 (or SIGTERM) of every rbd-nbd, and 1 s later
#             ceph-csi's attach of each device with its cookie
# A round with an I/O or verify error fails the bench.
. "$(dirname "$0")/lib.sh" # B, work, log, fio_run, fio_clean, cluster, csi_map, csi_attach
out=${1:-/vm-out/restart}
mkdir -p "$out"
n=${BENCH_RESTART_DEVICES:-8}
rounds=${BENCH_RESTART_ROUNDS:-5}
cluster || exit 1
k=(--id admin -m "$mon" --keyfile="$work/admin.key")
res=$out/rounds.tsv
printf 'kind\tround\tslowest_write_ms\tdetail\n' >"$res"
bad=0

# load SECONDS DEV...: fio on every DEV in the background; pids in $fios.
load() {
	local secs=$1 i=0 d; shift
	fios=()
	for d in "$@"; do
		fio_run "$work/fio-$i.out" "$d" 32M --iodepth=4 --rate_iops=50 --verify_backlog=16 \
			--time_based --runtime="$secs" &
		fios+=($!)
		i=$((i + 1))
	done
}
# settle KIND ROUND DETAIL: waits for the round's fio runs, checks them,
# and records the slowest write of any device (terse v3 field 80, µs).
settle() {
	local i rc worst=0 ms
	for i in "${!fios[@]}"; do
		wait "${fios[$i]}"; rc=$?
		fio_clean "$work/fio-$i.out" $rc || { log "FAIL $1 round $2: device $i: fio rc $rc"; bad=1; }
		ms=$(awk -F';' '/^3;/ { print int($80 / 1000) }' "$work/fio-$i.out")
		[ "${ms:-0}" -gt "$worst" ] && worst=$ms
	done
	printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$worst" "$3" >>"$res"
	log "$1 round $2: slowest write $worst ms $3"
}
daemon_log=/run/rbd-nbd-go/daemon.log
# gone PID...: waits up to 60 s for every PID to exit; false if one did not.
gone() {
	local i p alive
	for i in $(seq 600); do
		alive=0
		for p in "$@"; do kill -0 "$p" 2>/dev/null && alive=1; done
		[ $alive = 0 ] && return 0
		sleep 0.1
	done
	return 1
}
# logged KEY FROM: KEY's value in the daemon log's lines after line FROM.
logged() { tail -n +$(($2 + 1)) "$daemon_log" | grep -o "$1=[^ ]*" | tail -1 | cut -d= -f2; }

devs=() cookies=()
for i in $(seq 0 $((n - 1))); do
	rbd create --size 256M "rbd/r$i" || exit 1
	d=$(csi_map "rbd/r$i" "r$i-cookie" --connections 1 --resend-interval 2) || { log "FAIL map r$i"; exit 1; }
	devs+=("$d")
done
ours_round() { # ours_round KIND ROUND
	local from=$(wc -l <"$daemon_log") old t0 detail=""
	old=$(cat /run/rbd-nbd-go/daemon.lock)
	load 24 "${devs[@]}"
	sleep 8
	t0=$(date +%s%N)
	case $1 in
	handover)
		setsid "$B" daemon --state-dir /run/rbd-nbd-go --take-over >>"$daemon_log" 2>&1 </dev/null &
		local new=$!
		# The old one exits once it handed over; one that refused
		# serves on, and the new one then gives up.
		local i
		for i in $(seq 600); do kill -0 "$old" 2>/dev/null && kill -0 "$new" 2>/dev/null || break; sleep 0.1; done
		kill -0 "$old" 2>/dev/null && { log "FAIL $1 round $2: no handover"; tail -5 "$daemon_log"; bad=1; }
		detail="sockets unread $(logged reads_paused_for "$from")" ;;
	kill)
		kill -9 "$old"
		gone "$old" || { log "FAIL $1 round $2: pid $old outlived kill -9"; bad=1; }
		csi_attach rbd/r0 "${devs[0]}" r0-cookie || { log "FAIL attach after the kill"; bad=1; }
		detail="every device served $(( ($(date +%s%N) - t0) / 1000000 )) ms after the kill" ;;
	esac
	settle "$1" "$2" "$detail"
}
# Interleaved, so a slow spell of the box falls on every kind alike.
for r in $(seq 1 "$rounds"); do
	for kind in none handover kill; do ours_round $kind "$r"; done
done
for d in "${devs[@]}"; do "$B" unmap "$d" || bad=1; done

if [ "${BENCH_RESTART_PEER:-1}" != 0 ]; then
	ceph_map() { rbd-nbd "${k[@]}" --rbd-cache=false map "rbd/r$1" --try-netlink --reattach-timeout=300 --io-timeout=0 --cookie="c$1"; }
	devs=()
	for i in $(seq 0 $((n - 1))); do d=$(ceph_map "$i") || { log "FAIL rbd-nbd map r$i"; exit 1; }; devs+=("$d"); done
	for kind in ceph-kill ceph-term; do
		load 75 "${devs[@]}"
		sleep 8
		t0=$(date +%s%N)
		sig=-9; [ $kind = ceph-term ] && sig=-15
		pkill $sig -x rbd-nbd
		gone $(pgrep -x rbd-nbd) || { log "FAIL $kind: rbd-nbd still runs a minute after the signal"; bad=1; }
		sleep 1
		# All at once, as ceph-csi's volume healer starts them.
		attaches=()
		for i in "${!devs[@]}"; do
			rbd-nbd "${k[@]}" --rbd-cache=false attach "rbd/r$i" --device "${devs[$i]}" --try-netlink \
				--reattach-timeout=300 --io-timeout=0 --cookie="c$i" >/dev/null &
			attaches+=($!)
		done
		for i in "${!attaches[@]}"; do wait "${attaches[$i]}" || { log "FAIL rbd-nbd attach r$i"; bad=1; }; done
		settle $kind 1 "every device attached $(( ($(date +%s%N) - t0) / 1000000 )) ms after the signal"
	done
	for d in "${devs[@]}"; do rbd-nbd unmap "$d" || bad=1; done
fi

# The report: per kind, the rounds' slowest write (median and worst).
{
	echo "# Restart bench, $(date -u '+%F %H:%M UTC')"
	echo
	echo "$n devices, each under fio 4k randwrite QD4 at 50 IOPS with crc32c verify; the event 8 s into each round (e2e/restart.sh). Stall: the slowest write of any device in the round."
	echo
	echo "| event | rounds | stall, median | stall, worst | worst, over the floor's worst |"
	echo "|---|---:|---:|---:|---:|"
	floor=$(awk -F'\t' '$1 == "none" && $3 > w { w = $3 } END { print w + 0 }' "$res")
	for kind in $(awk -F'\t' 'NR > 1 && !s[$1]++ { print $1 }' "$res"); do
		vals=$(awk -F'\t' -v k="$kind" '$1 == k { print $3 }' "$res" | sort -n)
		c=$(echo "$vals" | wc -l)
		med=$(echo "$vals" | awk -v c="$c" '{ a[NR] = $1 } END { print (c % 2) ? a[(c + 1) / 2] : int((a[c / 2] + a[c / 2 + 1]) / 2) }')
		worst=$(echo "$vals" | tail -1)
		printf '| %s | %d | %d ms | %d ms | %+d ms |\n' "$kind" "$c" "$med" "$worst" $((worst - floor))
	done
	# Against the peer, same run: an upgrade is a SIGTERM for rbd-nbd.
	ratio() { awk -F'\t' -v a="$1" -v b="$2" '$1 == a && $3 > x { x = $3 } $1 == b && $3 > y { y = $3 }
		END { if (x && y) printf "%s against %s, worst stall: %.2fx\n", a, b, x / y }' "$res"; }
	echo
	ratio handover ceph-term
	ratio kill ceph-kill
	echo
	echo "| event | round | stall | |"
	echo "|---|---:|---:|---|"
	awk -F'\t' 'NR > 1 { printf "| %s | %s | %s ms | %s |\n", $1, $2, $3, $4 }' "$res"
} >"$out/restart.md"
cat "$out/restart.md"
exit $bad
