#!/bin/bash
# Helpers shared by the VM scripts (scenarios.sh, csi.sh): checks with
# timings and a recap of failures, fio verify, the dev cluster, and
# ceph-csi's map command line. Sourced, not run.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
B=$root/bin/rbd-nbd-go
export RBD_NBD_GO_STATE_DIR=/run/rbd-nbd-go
work=$(mktemp -d /tmp/e2e.XXXXXX)
fails=0
failed=()
recap=() # every failed check, repeated at the end where a CI log's tail shows it

log() { echo "e2e: $*"; }
check() { # check DESCRIPTION COMMAND...: one assertion
	local what=$1 t0; shift
	rm -f "$work/why"
	t0=$(date +%s%N)
	if "$@"; then log "  ok   $what ($(took "$t0"))"; return; fi
	# The recap at the end is what a CI log's tail shows: keep the why.
	local why=""
	[ -s "$work/why" ] && why=" -- $(tr '\n' ' ' < "$work/why" | cut -c1-300)"
	log "  FAIL $what ($(took "$t0"))$why"; fail_check "$what$why"
}
took() { # took T0NS: seconds since T0NS, to 0.1 s
	local ms=$((($(date +%s%N) - $1) / 1000000))
	printf '%d.%ds' $((ms / 1000)) $((ms % 1000 / 100))
}
fail_check() { scenario_failed=1; recap+=("$current: $1"); }
dur_ms() { # Go durations on stdin (1h2m3.5s, 937ms, 0s), one a line: whole ms
	awk '{ d = $1; ms = 0
		while (match(d, /^[0-9.]+(h|ms|m|s|µs|us|ns)/)) {
			v = substr(d, 1, RLENGTH); d = substr(d, RLENGTH + 1)
			n = v + 0; u = v; sub(/^[0-9.]+/, "", u)
			ms += u == "h" ? n * 3600000 : u == "m" ? n * 60000 : u == "s" ? n * 1000 : u == "ms" ? n : 0
		}
		printf "%d\n", ms + 0.5 }'
}
run_scenario() {
	local name=$1 fn=$2
	log "--- scenario $name"
	current=$name scenario_failed=0
	local t0=$(date +%s.%N)
	$fn
	local dt=$(echo "$(date +%s.%N) - $t0" | bc)
	if [ $scenario_failed -ne 0 ]; then
		fails=$((fails + 1)); failed+=("$name")
		log "FAIL scenario $name (${dt}s)"
		# A suite's own evidence (k8s.sh: the controller's and sidecars'
		# logs), now: a later step may hang and the run be cut off.
		if declare -F on_scenario_fail >/dev/null; then on_scenario_fail; fi
		tail -20 /run/rbd-nbd-go/daemon.log 2>/dev/null
		dmesg | tail -20
	else
		log "PASS scenario $name (${dt}s)"
	fi
}
all_io_flushers() { # every thread of PID has PF_MEMALLOC_NOIO (what PR_SET_IO_FLUSHER sets)
	local f fl n=0
	for f in /proc/$1/task/*/stat; do
		# Threads come and go (idle readers end theirs): one that is
		# gone by the time its flags are read is skipped, not flagless.
		fl=$(sed 's/.*) //' "$f" 2>/dev/null | awk '{print $7}')
		[ -n "$fl" ] || continue
		[ $(( fl & 0x80000 )) -ne 0 ] || { log "  thread ${f%/stat} lacks PF_MEMALLOC_NOIO (flags $fl)"; return 1; }
		n=$((n + 1))
	done
	log "  $n daemon threads, all IO flushers"
	[ $n -gt 1 ]
}
signal_threads() { # signal_threads PID SIGNO N: tgkill every thread of PID with SIGNO, N times
	python3 - "$@" <<'PY'
import ctypes, os, sys
pid, sig, n = (int(a) for a in sys.argv[1:4])
libc = ctypes.CDLL(None, use_errno=True)
for _ in range(n):
    for tid in os.listdir(f"/proc/{pid}/task"):
        libc.syscall(234, pid, int(tid), sig)  # SYS_tgkill (x86_64)
PY
}
no_devices() { # nothing mapped: list-mapped empty and no nbd has a server
	[ "$($B list-mapped --format json)" = "[]" ] || return 1
	for p in /sys/block/nbd*/pid; do [ -e "$p" ] && return 1; done
	return 0
}
fio_run() { # fio_run OUT FILE_OR_DEV SIZE [extra fio args]: 4k randwrite + crc32c verify
	local out=$1 target=$2 size=$3; shift 3
	timeout -k 5 ${FIO_TIMEOUT:-600} fio --name=verify --filename="$target" --size="$size" --ioengine=libaio \
		--direct=1 --rw=randwrite --bs=4k --iodepth=32 --verify=crc32c --verify_fatal=1 --do_verify=1 \
		--group_reporting --output-format=terse --terse-version=3 "$@" >"$out" 2>&1
}
fio_clean() { # fio_clean OUT RC: fio exited 0 and no job reported an error
	local out=$1 rc=$2
	[ "$rc" -eq 0 ] || { tail -5 "$out"; fio_why "$out" "fio exit $rc"; return 1; }
	# terse v3: field 5 is the job's error; verify errors fail the run.
	awk -F';' '/^3;/ { n++; if ($5 != 0) bad = 1 } END { exit (bad || n == 0) }' "$out" ||
		{ grep -v '^3;' "$out" | tail -5; fio_why "$out" "a job reported an error"; return 1; }
}
fio_why() { # fio_why OUT WHAT: fio's first error line, for check's recap
	{ echo "$2:"; grep -v '^3;' "$1" | grep -m2 -iE 'error|verify|fail|invalid|timed out' || grep -v '^3;' "$1" | tail -2; } > "$work/why"
}
fio_verify() { fio_run "$work/fio.out" "$@"; fio_clean "$work/fio.out" $?; }

# --- the cluster (inside the VM, on lo)
cluster_up=0
cluster() {
	[ $cluster_up -eq 1 ] && return 0
	[ $cluster_up -eq 2 ] && { fail_check "dev cluster (did not come up earlier)"; return 1; }
	local t0=$(date +%s.%N)
	export CEPH_CONF
	local err
	CEPH_CONF=$(scripts/ceph-dev-cluster start "$work/ceph" --timeout 300 2>"$work/cluster.err") ||
		{ err=$(tail -1 "$work/cluster.err"); cluster_up=2
		  log "  FAIL dev cluster: $err"; tail -5 "$work/ceph/log/mon.a.log"; fail_check "dev cluster: $err"; return 1; }
	ceph-authtool "$work/ceph/keyring" -p -n client.admin > "$work/admin.key" # no slow ceph CLI call
	mon=$(awk -F' *= *' '/mon[ _]host/ {print $2; exit}' "$CEPH_CONF")
	cluster_up=1
	log "  cluster up in $(echo "$(date +%s.%N) - $t0" | bc)s (mon $mon)"
}

# The flags ceph-csi passes to rbd-nbd, verbatim (internal/rbd/rbd_attach.go).
csi_map() { # csi_map IMAGE COOKIE [extra]
	local img=$1 cookie=$2; shift 2
	$B --id admin -m "$mon" --keyfile="$work/admin.key" --log-file "$work/rbd-nbd-$cookie.log" \
		map "$img" --try-netlink --reattach-timeout=300 --io-timeout=0 --cookie="$cookie" "$@"
}
csi_attach() { # csi_attach IMAGE DEVICE COOKIE: ceph-csi's attach after its server died
	$B --id admin -m "$mon" --keyfile="$work/admin.key" attach "$1" --device "$2" --try-netlink \
		--reattach-timeout=300 --io-timeout=0 --cookie="$3" >/dev/null
}


# --- a hung device ends the run, with its evidence
# The kernel retries a timed-out NBD request forever (the daemon replaces
# the socket it shut, "Connection timed out, retrying (N/M alive)" every
# io-timeout; with a resend interval it only logs "Possible stuck request"
# every interval), so a request the daemon never answers hangs its test until
# the VM's timeout, and a CI run's tail then shows only the retries. So a
# device timing out with live connections, and completing no I/O, for
# HANG_SECS on end (no fault
# a test makes comes near: the soak's OSD restart stalls under a minute,
# and a dead daemon leaves no connection alive) dumps what
# explains it -- the daemon's slow-request lines, its goroutines (SIGQUIT
# ends it), the image's lock and watchers, the kernel's in-flight counts --
# into $E2E_OUT/hang (or $work/hang) and its summary to the console, then
# powers the VM off: the run fails in minutes, its tail saying why.
hang_watch() {
	local secs=${HANG_SECS:-180} out=${E2E_OUT:-$work}/hang first=() now dev line t
	declare -A since=() done_io=()
	while sleep 15; do
		now=$(cut -d. -f1 /proc/uptime)
		# nbd devices with a timeout in the last 30 s, by dmesg's clock
		local hot
		hot=$(dmesg 2>/dev/null | sed -n -e 's/^\[ *\([0-9]*\)\.[0-9]*\] block \(nbd[0-9]*\): Connection timed out, retrying ([1-9][0-9]*\/.*/\1 \2/p' \
			-e 's/^\[ *\([0-9]*\)\.[0-9]*\] block \(nbd[0-9]*\): Possible stuck request .*/\1 \2/p' |
			awk -v now="$now" '$1 >= now - 30 {print $2}' | sort -u)
		for dev in "${!since[@]}"; do grep -qx "$dev" <<<"$hot" || unset "since[$dev]" "done_io[$dev]"; done
		for dev in $hot; do
			# A hang makes no progress: completed reads and writes
			# (stat fields 1 and 5) restart the clock. Faults one
			# after another (the soak's, on a slow VM) keep a device
			# timing out for minutes while its I/O goes on. (A request
			# stuck while the rest complete is left to the test's own
			# timeout.)
			t=$(awk '{print $1 + $5}' /sys/block/$dev/stat 2>/dev/null)
			if [ -z "${since[$dev]:-}" ] || [ "$t" != "${done_io[$dev]:-}" ]; then
				since[$dev]=$now done_io[$dev]=$t
			fi
			[ $((now - since[$dev])) -ge "$secs" ] && { hang_dump "$dev" $((now - since[$dev])) "$out"; return; }
		done
	done
}
hang_dump() { # hang_dump DEV SECONDS OUT
	local dev=$1 secs=$2 out=$3 pid log=/run/rbd-nbd-go/daemon.log
	# Started before the cluster: its conf is where cluster() puts it.
	export CEPH_CONF=${CEPH_CONF:-$work/ceph/ceph.conf}
	mkdir -p "$out"
	dmesg -n 1 2>/dev/null # the kernel's retries off the console from here
	{
		echo "== /dev/$dev: requests timed out for $secs s"
		echo "== inflight (read write): $(cat /sys/block/$dev/inflight 2>/dev/null)"
		echo "== list-mapped"; timeout 10 "$B" list-mapped 2>&1
		echo "== the daemon's slow requests, handovers, replaced sockets (last 40)"
		grep -aE 'slow|stale|held a write|dead|handover|handed|took over|error' "$log" 2>/dev/null | tail -40
		echo "== daemon.log, last 40"; tail -40 "$log" 2>/dev/null
		mount -t debugfs none /sys/kernel/debug 2>/dev/null
		echo "== the kernel's requests in flight on $dev (debugfs)"; cat /sys/kernel/debug/nbd/$dev/tasks 2>&1 | head -20
		pid=$(pgrep -o -f 'rbd-nbd-go daemon')
		echo "== the daemon's threads, by wait channel"
		for t in /proc/$pid/task/*/wchan; do cat "$t" 2>/dev/null; echo; done | sort | uniq -c | sort -rn | head
	} >"$out/summary.txt" 2>&1
	local img
	for img in $(rbd ls rbd 2>/dev/null); do
		echo "== rbd/$img: $(timeout 20 rbd status "rbd/$img" 2>&1 | tr '\n' ' ') locks: $(timeout 20 rbd lock ls "rbd/$img" 2>&1 | tr '\n' ' ')"
	done >>"$out/summary.txt"
	cp "$log" "$out/daemon.log" 2>/dev/null
	dmesg >"$out/dmesg.txt" 2>/dev/null
	# The goroutines: who holds the request (SIGQUIT ends the daemon).
	# By name: a pod's daemon writes its own namespace's pid in the lock.
	pid=$(pgrep -o -f 'rbd-nbd-go daemon')
	if [ -n "$pid" ] && kill -QUIT "$pid" 2>/dev/null; then
		sleep 3
		sed -n '/^SIGQUIT: quit/,$p' "$log" >"$out/goroutines.txt"
	fi
	{
		cat "$out/summary.txt"
		echo "== goroutines waiting longest (full dump in $out/goroutines.txt)"
		grep -aA12 -E '^goroutine [0-9]+ \[[^]]*, [0-9]+ minutes\]' "$out/goroutines.txt" 2>/dev/null | head -120
		log "HANG: /dev/$dev timed out requests for $secs s; the run is stopped (evidence above and in $out)"
	} >/dev/ttyS0 2>&1
	sync
	echo o >/proc/sysrq-trigger
}
# Every VM script watches from the start (hang_watch's subshell dies with
# the VM, or is killed when the script exits).
hang_watch &
hang_watcher=$!
trap 'kill $hang_watcher 2>/dev/null' EXIT
