#!/bin/bash
# Kernel-NBD scenarios, run inside the VM (scripts/vm/vm.sh) as root:
#   e2e/scenarios.sh [a b c ... k]    (default: all)
# Each scenario prints PASS/FAIL lines; the exit status is the number of
# failed scenarios. Uses bin/rbd-nbd-go from the checkout.
set -uo pipefail
cd "$(dirname "$0")/.."
. e2e/lib.sh

scenario_a() { # mem and file specs: ext4, fio verify, unmap
	local dev
	check "map mem:256M prints a device" eval 'dev=$($B map mem:256M) && [ -b "$dev" ]'
	check "nbd module loaded on demand" test -d /sys/module/nbd
	local pid=$(cat /run/rbd-nbd-go/daemon.lock)
	check "every daemon thread is marked PR_SET_IO_FLUSHER" all_io_flushers "$pid"
	check "daemon memory is locked (VmLck > 0)" eval '[ $(awk "/VmLck/ {print \$2}" /proc/$pid/status) -gt 0 ]'
	check "mkfs.ext4" mkfs.ext4 -q -F "$dev"
	mkdir -p "$work/mnt"
	check "mount" mount "$dev" "$work/mnt"
	check "fio verify on ext4" fio_verify "$work/mnt/f" 64M
	check "umount" umount "$work/mnt"
	check "unmap" $B unmap "$dev"
	truncate -s 128M "$work/disk.img"
	check "map file:" eval 'dev=$($B map --connections 2 file:$work/disk.img) && [ -b "$dev" ]'
	check "mkfs.ext4 + mount + fio on file:" eval 'mkfs.ext4 -q -F $dev && mount $dev $work/mnt && fio_verify $work/mnt/f 32M && umount $work/mnt'
	check "unmap by spec" $B unmap "file:$work/disk.img"
	check "list-mapped is empty" no_devices
	check "image file holds the filesystem" eval 'blkid -p "$work/disk.img" | grep -q ext4'
}

scenario_b() { # a real RBD image with ceph-csi's flags, xfs
	cluster || return
	rbd create --size 512M rbd/vol-b
	local dev
	check "map with ceph-csi's command line" eval 'dev=$(csi_map rbd/vol-b csi-vol-b) && [ -b "$dev" ]'
	check "list-mapped --format=json has rbd-nbd's fields" eval '$B list-mapped --format=json | python3 -c "
import json,sys; l=json.load(sys.stdin); d=l[0]
assert (d[\"pool\"],d[\"namespace\"],d[\"image\"],d[\"snap\"],d[\"device\"],d[\"cookie\"])==(\"rbd\",\"\",\"vol-b\",\"-\",\"$dev\",\"csi-vol-b\"), d
assert isinstance(d[\"id\"], int) and d[\"id\"]>0"'
	check "backend identifier is the cookie" eval '[ "$(cat /sys/block/${dev#/dev/}/backend)" = csi-vol-b ]'
	check "the key is not in any argv" eval '! grep -qF "$(cat $work/admin.key)" /proc/[0-9]*/cmdline'
	check "the metrics name the image, and carry no key" eval 'scrape >$work/mb && grep -q "image=\"vol-b\"" $work/mb && ! grep -qF "$(cat $work/admin.key)" $work/mb'
	check "mkfs.xfs" mkfs.xfs -q -f "$dev"
	mkdir -p "$work/mnt"
	check "mount xfs" mount "$dev" "$work/mnt"
	check "fio verify on xfs" fio_verify "$work/mnt/f" 32M
	# librbd's completion thread sends most replies itself: counted too.
	check "the metrics count the writes through librbd" eval 'scrape >$work/mb2 && [ $(series $work/mb2 rbd_nbd_requests_total $dev write) -gt 1000 ] &&
		[ $(series $work/mb2 rbd_nbd_request_backend_seconds_count $dev write) -gt 1000 ]'
	check "umount" umount "$work/mnt"
	check "unmap (ceph-csi: by device)" $B unmap "$dev"
	local out rc
	out=$($B unmap rbd/vol-b 2>&1); rc=$?
	check "second unmap says rbd-nbd's 'not mapped' (exit $rc)" eval '[ $rc -eq 3 ] && [ "$out" = "rbd-nbd: rbd/vol-b is not mapped" ]'
	rbd export rbd/vol-b "$work/vol-b.raw" >/dev/null 2>&1
	check "data is in the image (xfs signature via rbd export)" eval '[ "$(head -c 4 $work/vol-b.raw)" = XFSB ]'
	rm -f "$work/vol-b.raw"
	check "list-mapped is empty" no_devices
}

scenario_c() { # raw device, 4 connections = 4 hardware queues (needs 4 CPUs)
	local dev
	check "map --connections 4" eval 'dev=$($B map --connections 4 mem:256M) && [ -b "$dev" ]'
	# blk-mq caps hardware queues at the CPU count (make e2e boots 4 vCPUs).
	local want=$(( $(nproc) < 4 ? $(nproc) : 4 ))
	check "$want hardware queues (4 connections, $(nproc) CPUs)" eval '[ $(ls /sys/block/${dev#/dev/}/mq | wc -l) -eq $want ]'
	check "max_sectors_kb raised to 4096" eval '[ $(cat /sys/block/${dev#/dev/}/queue/max_sectors_kb) -eq 4096 ]'
	check "fio verify on the raw device, 4 jobs" fio_verify "$dev" 16M --numjobs=4 --offset_increment=64M
	check "1M sequential verify" fio_verify "$dev" 64M --rw=write --bs=1M --iodepth=8
	check "unmap" $B unmap "$dev"
}

scenario_d() { # rbd resize grows the device with no remap
	cluster || return
	rbd create --size 64M rbd/vol-d
	local dev
	check "map" eval 'dev=$(csi_map rbd/vol-d d) && [ -b "$dev" ]'
	check "size 64M" eval '[ $(blockdev --getsize64 $dev) -eq $((64<<20)) ]'
	rbd resize --size 192M rbd/vol-d >/dev/null 2>&1
	local n=0
	while [ $(blockdev --getsize64 $dev) -ne $((192<<20)) ] && [ $n -lt 50 ]; do sleep 0.1; n=$((n+1)); done
	check "size 192M after rbd resize, same device" eval '[ $(blockdev --getsize64 $dev) -eq $((192<<20)) ]'
	check "I/O in the new space" fio_verify "$dev" 32M --offset=160M
	check "unmap" $B unmap "$dev"
}

scenario_e() { # kill -9 the daemon mid-fio; ceph-csi's attach; no errors; then with a resend interval
	cluster || return
	dmesg -C
	rbd create --size 256M rbd/vol-e
	local dev pid
	check "map" eval 'dev=$(csi_map rbd/vol-e vol-e-cookie --connections 2) && [ -b "$dev" ]'
	fio_run "$work/fio-e.out" "$dev" 32M --iodepth=16 &
	local fiopid=$!
	sleep 4
	pid=$(cat /run/rbd-nbd-go/daemon.lock)
	check "daemon pid known" test -n "$pid"
	check "fio is mid-run at the kill" kill -0 $fiopid
	kill -9 "$pid"
	log "  killed daemon $pid mid-write"
	sleep 2
	check "ceph-csi's attach command reattaches" csi_attach rbd/vol-e "$dev" vol-e-cookie
	check "a new daemon serves it" eval '[ "$(cat /run/rbd-nbd-go/daemon.lock)" != "$pid" ]'
	wait $fiopid
	local rc=$?
	check "fio finished without I/O or verify errors (rc $rc)" fio_clean "$work/fio-e.out" $rc
	dmesg > "$work/dmesg"
	check "kernel logged no I/O error" eval '! grep -q "I/O error, dev ${dev#/dev/}" $work/dmesg'
	# A restart of the daemon alone (SIGTERM, then any command) also reattaches.
	kill "$(cat /run/rbd-nbd-go/daemon.lock)"; sleep 1
	check "list-mapped restarts the daemon and shows the device" eval '$B list-mapped > $work/lm && grep -q "$dev" $work/lm'
	check "I/O after the restart" fio_verify "$dev" 16M
	check "unmap" $B unmap "$dev"
	resend_after_kill
}

resend_after_kill() { # scenario e's second half: one connection, io-timeout 0, resend-interval 2
	# What a kill -9 had in flight is sent again once the new daemon has
	# replaced the socket, at the block layer's next 2 s tick: the kernel
	# logs "Possible stuck request" (NBD's timeout is 0) and never "timed
	# out" (no retry of a live socket's request). At the kernel's 30 s it
	# would stall 30 s; the bound is loose, the mechanism is what is checked.
	rbd create --size 256M rbd/vol-e3
	local dev pid
	check "map, one connection, resend-interval 2" eval 'dev=$(csi_map rbd/vol-e3 vol-e3-cookie --connections 1 --resend-interval 2) && [ -b "$dev" ]'
	check "the queue's request timer is 2 s" eval '[ "$(cat /sys/block/${dev#/dev/}/queue/io_timeout)" = 2000 ]'
	dmesg -C
	# Time-based: no verify phase after the writes, so each block is read
	# back and checked 16 writes after it was written.
	fio_run "$work/fio-e3.out" "$dev" 32M --iodepth=16 --verify_backlog=16 --time_based --runtime=30 &
	local fiopid=$!
	sleep 5
	pid=$(cat /run/rbd-nbd-go/daemon.lock)
	local t0=$(date +%s%N)
	kill -9 "$pid"
	sleep 1
	check "attach after the kill" csi_attach rbd/vol-e3 "$dev" vol-e3-cookie
	log "  attached $(( ($(date +%s%N) - t0) / 1000000 )) ms after the kill"
	wait $fiopid
	local rc=$?
	check "fio finished without I/O or verify errors (rc $rc)" fio_clean "$work/fio-e3.out" $rc
	# terse v3: field 80 is the writes' longest latency, in µs.
	local max_ms=$(awk -F';' '/^3;/ { print int($80 / 1000) }' "$work/fio-e3.out")
	log "  slowest write: $max_ms ms"
	dmesg > "$work/dmesg-e3"
	check "the kernel resent (stuck, then requeued), never timed a request out" \
		eval 'grep -q "Possible stuck request" $work/dmesg-e3 && ! grep -qE "timed out|I/O error" $work/dmesg-e3'
	check "the kill stalled writes under 20 s, not the kernel's 30 s" eval '[ -n "$max_ms" ] && [ "$max_ms" -lt 20000 ]'
	check "unmap" $B unmap "$dev"
}

scenario_f() { # bad input: clear errors, nothing left behind
	cluster || return
	local out rc
	out=$(csi_map rbd/no-such-image f 2>&1); rc=$?
	check "missing image fails in one line naming it" eval '[ $rc -ne 0 ] && [ $(echo "$out" | wc -l) -eq 1 ] && echo "$out" | grep -q "no-such-image does not exist"'
	log "  -> $out"
	ceph-authtool --gen-print-key > "$work/bad.key"
	out=$($B --id admin -m "$mon" --keyfile="$work/bad.key" --op-timeout 10s map rbd/vol-b 2>&1); rc=$?
	check "wrong key fails clearly" eval '[ $rc -ne 0 ] && echo "$out" | grep -q "permission denied (wrong key"'
	log "  -> $out"
	check "the bad key is not echoed" eval '! echo "$out" | grep -qF "$(cat $work/bad.key)"'
	echo "not-a-key" > "$work/junk.key"
	out=$($B --id admin -m "$mon" --keyfile="$work/junk.key" --op-timeout 10s map rbd/vol-b 2>&1); rc=$?
	check "malformed key fails clearly" eval '[ $rc -ne 0 ] && echo "$out" | grep -q "malformed key"'
	log "  -> $out"
	check "nothing left behind" no_devices
	rbd create --size 64M rbd/vol-f
	local dev
	check "map" eval 'dev=$(csi_map rbd/vol-f f) && mkfs.ext4 -q -F $dev && mkdir -p $work/mnt && mount $dev $work/mnt'
	out=$($B unmap "$dev" 2>&1); rc=$?
	check "unmap of a mounted device is refused" eval '[ $rc -ne 0 ] && echo "$out" | grep -q "is busy (mounted"'
	log "  -> $out"
	check "still mapped and usable" eval 'echo hi > $work/mnt/x && sync && [ -e /sys/block/${dev#/dev/}/pid ]'
	out=$(csi_map rbd/vol-f f2 --device "$dev" 2>&1); rc=$?
	check "map onto a busy device is refused" eval '[ $rc -ne 0 ] && echo "$out" | grep -q "is busy"'
	log "  -> $out"
	check "bad flag is one line" eval '[ $($B map --no-such-flag x 2>&1 | wc -l) -eq 1 ]'
	umount "$work/mnt"
	check "unmap after umount" $B unmap "$dev"
	# Another tool disconnects a device: the daemon lets go of the image.
	check "map --exclusive" eval 'dev=$(csi_map rbd/vol-f f3 --exclusive) && rbd status rbd/vol-f | grep -q watcher='
	check "Ceph's rbd-nbd unmaps it" rbd-nbd unmap "$dev"
	released "" vol-f
	# The same with the device mounted: the kernel keeps a disconnected
	# device while its filesystem holds it, so I/O must fail (not hang),
	# and the daemon lets go of the image once the filesystem lets go.
	check "map --exclusive and mount" eval 'dev=$(csi_map rbd/vol-f f4 --exclusive) && mount $dev $work/mnt && echo a > $work/mnt/a && sync'
	check "Ceph's rbd-nbd disconnects it while mounted" rbd-nbd unmap "$dev"
	check "writes to the filesystem fail, not hang" eval 'timeout 60 sh -c "echo z > $work/mnt/z && sync -f $work/mnt/z"; rc=$?; echo "rc $rc" > $work/why; [ $rc -ne 0 ] && [ $rc -ne 124 ]'
	umount "$work/mnt" 2>/dev/null
	released "after umount " vol-f
}

released() { # released WHEN IMAGE: the daemon let go of rbd/IMAGE, which another tool disconnected
	local img=$2
	check "${1}the daemon releases it" eval 'for i in $(seq 80); do $B list-mapped | grep -q $img || break; sleep 0.25; done; ! $B list-mapped | grep -q $img'
	check "and closes the image (no watcher)" eval 'rbd status rbd/$img > $work/st; cat $work/st > $work/why; grep -q "Watchers: none" $work/st'
	check "nothing left behind" no_devices
}

scenario_g() { # quiesce: snapshot freezes and thaws the filesystem
	cluster || return
	rbd create --size 64M rbd/vol-g
	local dev
	check "map --quiesce" eval 'dev=$(csi_map rbd/vol-g g --quiesce) && mkfs.ext4 -q -F $dev && mount $dev $work/mnt && echo before > $work/mnt/f'
	check "rbd snap create succeeds" eval 'rbd snap create rbd/vol-g@s1 >/dev/null 2>&1 && rbd snap ls rbd/vol-g > $work/snaps && grep -q s1 $work/snaps'
	grep "quiesce" /run/rbd-nbd-go/daemon.log > "$work/q"
	check "the filesystem was frozen and thawed around it" eval 'grep -q "quiesce=true target=$work/mnt err=<nil>" $work/q && grep -q "quiesce=false target=$work/mnt err=<nil>" $work/q'
	check "filesystem writable after the snapshot" eval 'echo after > $work/mnt/f && sync'
	umount "$work/mnt"
	check "unmap" $B unmap "$dev"
}

scenario_h() { # the ioctl fallback: forced, then chosen by itself in a netns without the nbd genl family
	pkill -f "$B daemon"; sleep 0.5
	local dev
	check "map through ioctls" eval 'dev=$(RBD_NBD_GO_KERNEL_INTERFACE=ioctl $B map --connections 2 mem:128M) && [ -b "$dev" ]'
	# NBD_DO_IT starts the device after the setup ioctls return: map must
	# wait for it (it once printed the device while its size was still 0).
	check "the device has its size when map returns" eval '[ $(blockdev --getsize64 $dev) -eq $((128 << 20)) ]'
	# The kernel stops a device whose NBD_DO_IT a signal interrupts, and
	# Go signals its own threads (SIGURG preempts): once in 40-100 maps
	# the disk died right after map. Every thread gets SIGURG here.
	check "the device survives SIGURG on every daemon thread" eval 'signal_threads $(cat /run/rbd-nbd-go/daemon.lock) 23 20 && sleep 0.5 &&
		[ -e /sys/block/${dev#/dev/}/pid ] && [ $(blockdev --getsize64 $dev) -eq $((128 << 20)) ]'
	check "daemon uses ioctl" eval 'tail -3 /run/rbd-nbd-go/daemon.log > $work/dl && grep -q "kernel=ioctl" $work/dl'
	check "2 hardware queues" eval '[ $(ls /sys/block/${dev#/dev/}/mq | wc -l) -eq 2 ]'
	check "fio verify" fio_verify "$dev" 32M
	check "unmap" $B unmap "$dev"
	check "device released" eval '[ ! -e /sys/block/${dev#/dev/}/pid ]'
	pkill -f "$B daemon"; sleep 0.5
	# The fallback chosen by itself: the kernel's nbd genl family is not
	# netns-aware, so a daemon started in a new network namespace finds
	# none, as on a kernel without it.
	check "map from a netns without the nbd genl family" eval 'dev=$(unshare -n $B map mem:64M) && [ -b "$dev" ]'
	check "the daemon chose ioctl by itself" eval 'tail -3 /run/rbd-nbd-go/daemon.log > $work/dl && grep -q "kernel=ioctl" $work/dl'
	# Disconnected by another tool, an ioctl device is released too.
	check "Ceph's rbd-nbd unmaps it" rbd-nbd unmap "$dev"
	check "the daemon releases it" eval 'for i in $(seq 40); do [ "$($B list-mapped --format json)" = "[]" ] && break; sleep 0.25; done; no_devices'
	pkill -f "$B daemon"; sleep 0.5
}

scenario_i() { # io-timeout fires while the daemon is frozen: LINK_DEAD, new sockets, no errors
	local dev pid
	check "map --io-timeout 3 --connections 2" eval 'dev=$($B map --connections 2 --io-timeout 3 --reattach-timeout 60 mem:128M) && [ -b "$dev" ]'
	dmesg -C
	fio_run "$work/fio-i.out" "$dev" 16M --iodepth=8 --loops=3 &
	local fiopid=$!
	sleep 2
	pid=$(cat /run/rbd-nbd-go/daemon.lock)
	kill -STOP "$pid"; sleep 8; kill -CONT "$pid"
	log "  froze the daemon 8 s (io-timeout 3 s)"
	wait $fiopid
	local rc=$?
	dmesg > "$work/dmesg-i"
	check "the kernel timed requests out" grep -q "timed out" "$work/dmesg-i"
	check "dead connections were replaced (LINK_DEAD)" eval 'grep -q "replaced a dead connection.*err=<nil>" /run/rbd-nbd-go/daemon.log'
	check "fio finished without I/O or verify errors (rc $rc)" fio_clean "$work/fio-i.out" $rc
	check "unmap" $B unmap "$dev"
}
scenario_j() { # LUKS through librbd and --exclusive: encrypted at rest, wrong passphrase refused, both kept across kill -9
	cluster || return
	rbd create --size 64M rbd/vol-j
	printf 'correct horse battery' > "$work/pass"
	printf 'wrong' > "$work/badpass"
	check "rbd encryption format luks1" eval 'rbd encryption format rbd/vol-j luks1 "$work/pass" >/dev/null 2>&1'
	local out rc dev pid
	out=$(csi_map rbd/vol-j vol-j --encryption-format luks1 --encryption-passphrase-file "$work/badpass" 2>&1); rc=$?
	log "  wrong passphrase: exit $rc: $out"
	check "a wrong passphrase: one line, non-zero exit" eval '[ $rc -ne 0 ] && [ $(printf "%s\n" "$out" | wc -l) -eq 1 ]'
	check "no device left behind" no_devices
	check "map --exclusive --encryption-format luks1" eval 'dev=$(csi_map rbd/vol-j vol-j --exclusive --encryption-format luks1 --encryption-passphrase-file "$work/pass") && [ -b "$dev" ]'
	check "the device is the image less the LUKS header" eval 's=$(blockdev --getsize64 $dev) && [ $s -lt $((64 << 20)) ] && [ $s -ge $((56 << 20)) ]'
	check "the passphrase is not in any argv" eval '! grep -qF "correct horse" /proc/[0-9]*/cmdline'
	yes rbd-nbd-go-plaintext-marker 2>/dev/null | head -c 1M > "$work/marker"
	check "write a marker" dd if="$work/marker" of="$dev" bs=1M oflag=direct conv=fsync status=none
	pid=$(cat /run/rbd-nbd-go/daemon.lock)
	kill -9 "$pid"; sleep 1
	check "list-mapped after kill -9 starts a daemon that reattaches it" eval '$B list-mapped > $work/lm && grep -q "$dev" $work/lm && [ "$(cat /run/rbd-nbd-go/daemon.lock)" != "$pid" ]'
	local n=$(nproc)
	check "it reattached all $n connections, no more" eval 'grep "msg=attached device=$dev" /run/rbd-nbd-go/daemon.log | tail -1 | grep -qE "connections=$n( |\$)"'
	check "the new daemon holds the exclusive lock" eval 'rbd lock ls rbd/vol-j 2>/dev/null | grep -q "1 exclusive lock"'
	check "the marker reads back decrypted" eval 'dd if=$dev bs=1M count=1 iflag=direct status=none > $work/back && cmp $work/marker $work/back'
	check "unmap" $B unmap "$dev"
	rbd export rbd/vol-j "$work/vol-j.raw" >/dev/null 2>&1
	check "the image is LUKS at rest" eval '[ "$(head -c 4 $work/vol-j.raw)" = LUKS ]'
	check "no plaintext in the image" eval '! grep -q plaintext-marker $work/vol-j.raw'
	rm -f "$work/vol-j.raw"
}

kernel_left_unread() { # kernel_left_unread DMESG LOG: see scenario k
	local dev devs
	devs=$(grep -oE "nbd[0-9]+: (Connection timed out|Unexpected reply)" "$1" | cut -d: -f1 | sort -u)
	[ -n "$devs" ] || return 0
	# The devices that held an image while the watchdog said the kernel
	# left its replies unread.
	awk '/msg=mapped device=/ || /msg=unmapped device=/ {
			d = $0; sub(/.* device=\/dev\//, "", d); sub(/ .*/, "", d)
			s = $0; sub(/.* spec=/, "", s); sub(/ .*/, "", s)
			if ($0 ~ /msg=mapped/) held[s] = d; else delete held[s]
		}
		/msg="nbd: peer has not read our replies"/ {
			s = $0; sub(/.* spec=/, "", s); sub(/ .*/, "", s)
			if (s in held) print held[s]
		}' "$2" | sort -u >"$work/unread-devs"
	for dev in $devs; do
		grep -qx "$dev" "$work/unread-devs" || { echo "$dev: a request timed out with no reply of ours left unread" >>"$work/why"; return 1; }
		log "  $dev: the kernel left our replies unread and timed them out (workqueue rescuer, Linux < 7.0)"
	done
	# The kernel rate-limits those lines (ten in 5 s, for all devices):
	# a device may have timed out unnamed. So, as well: the daemon held
	# no request for 10 s (in librbd, unsent, or unread in its socket).
	if grep -E "nbd: slow request|nbd: socket holds a request not read" "$2" >>"$work/why"; then return 1; fi
}

scenario_k() { # many devices mapped and unmapped under load: no unmap waits for an I/O timeout
	cluster || return
	# 20 devices: the module makes 16 at load, so some are made on demand.
	# E2E_MANY and E2E_MANY_ROUNDS make it longer (one round takes 2-3
	# minutes under TCG).
	local n=${E2E_MANY:-20} i d rc dev pids=() devs=() worst=0 ms t0
	for i in $(seq 1 "$n"); do rbd create --size 64M rbd/many-$i >/dev/null 2>&1 || { fail_check "rbd create many-$i"; return; }; done
	: >"$work/unmap-k.ms"
	unmap_timed() { # unmap DEV, noting how long it took
		t0=$(date +%s%N)
		$B unmap "$1" || { log "  unmap $1 failed"; fail_check "unmap $1"; }
		ms=$((($(date +%s%N) - t0) / 1000000))
		echo "$ms $1" >>"$work/unmap-k.ms"
	}
	dmesg -C
	local klog # scenario k's part of the daemon's log starts after this line
	klog=$(wc -l </run/rbd-nbd-go/daemon.log 2>/dev/null) || klog=0
	for round in $(seq 1 "${E2E_MANY_ROUNDS:-1}"); do
		devs=() pids=()
		for i in $(seq 1 "$n"); do
			dev=$(csi_map rbd/many-$i many-$i) || { fail_check "map many-$i (round $round)"; continue; }
			devs+=("$dev")
		done
		log "  round $round: ${#devs[@]} devices mapped"
		# Load on the first half for the whole round: fio writes, flushes
		# (fdatasync) and verifies.
		local half=$(( ${#devs[@]} / 2 ))
		for d in "${devs[@]:0:$half}"; do
			fio_run "$work/fio-k-${d#/dev/}.out" "$d" 8M --iodepth=16 --fdatasync=8 &
			pids+=($!)
		done
		sleep 2
		# The second half while that runs: a burst of writes and a flush,
		# then unmapped at once (the moment of the 30-s unmap once seen).
		for d in "${devs[@]:$half}"; do
			dd if=/dev/urandom of="$d" bs=1M count=4 oflag=direct conv=fsync status=none || fail_check "dd to $d"
			unmap_timed "$d"
		done
		for i in "${!pids[@]}"; do
			wait "${pids[$i]}"; rc=$?
			d=${devs[$i]}
			check "round $round: fio on $d without errors (rc $rc)" fio_clean "$work/fio-k-${d#/dev/}.out" $rc
			unmap_timed "$d" # right after its load
		done
	done
	read -r worst d < <(sort -n "$work/unmap-k.ms" | tail -1)
	log "  $(wc -l <"$work/unmap-k.ms") unmaps, median $(sort -n "$work/unmap-k.ms" | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}') ms, worst $worst ms ($d)"
	# Where the slowest one waited (page cache, kernel, backend close).
	grep "msg=unmapped device=$d " /run/rbd-nbd-go/daemon.log | tail -1
	# The bug this hunts: an unmap that sat out the kernel's 30-s request
	# timeout (io-timeout 0 is the kernel's 30 s). How fast unmaps are is
	# a benchmark's business, not this check's: under TCG with ten fio
	# jobs running they take 1-5 s.
	check "no unmap waited for the kernel's 30 s request timeout (worst $worst ms)" eval '[ "$worst" -lt 20000 ]'
	# What the daemon spent on each unmap (the `took` of its `unmapped`
	# line: the device's lock, sync, disconnect, stop), without the CLI's
	# own start-up, which under TCG with ten fio jobs running takes
	# seconds. 5 s is issue 14's bound: 5x the worst seen, and a sixth of
	# the timeout a stuck request would add.
	tail -n +$((klog + 1)) /run/rbd-nbd-go/daemon.log >"$work/daemon-k.log"
	local took
	took=$(grep "msg=unmapped device=.* spec=rbd/many-" "$work/daemon-k.log" | sed -n 's/.* took=\([^ ]*\) .*/\1/p' | dur_ms | sort -n | tail -1)
	check "the daemon's side of every unmap took under 5 s (worst ${took:-?} ms)" eval '[ -n "$took" ] && [ "$took" -lt 5000 ]'
	dmesg > "$work/dmesg-k"
	check "no I/O error, no request stuck on one connection" eval '! grep -E "I/O error|Possible stuck request" $work/dmesg-k'
	# A request the kernel timed out must be one whose reply we had sent
	# and the kernel never read, which the daemon's watchdog names. Linux
	# before 7.0 reads each socket of a device in a work item that lasts
	# as long as the socket; when it is slow to make workers (TCG, a
	# busy or short-of-memory node) the workqueue's rescuer runs the
	# pending items of a device one after another, so a freshly mapped
	# device's second socket is not read until the first one dies, and
	# its requests wait for the 30 s timeout and a retry on another
	# socket. (Linux 7.0's rescuer takes one item at a time: "workqueue:
	# Process rescuer work items one-by-one using a cursor".) Any other
	# timeout, a late or lost reply of ours, fails here.
	check "every request the kernel timed out had been answered, unread by the kernel" kernel_left_unread "$work/dmesg-k" "$work/daemon-k.log"
	# Where a slow request waited, if one did: the daemon's watchdog, the OSD.
	grep -E "slow request|not read our replies" "$work/daemon-k.log" | tail -5
	grep -h "slow request\|slow ops" "$work"/ceph/log/osd*.log 2>/dev/null | tail -3
	check "list-mapped is empty" no_devices
}

# Every daemon these scenarios start serves metrics: all of them run
# with it on, and scenario l checks what it says.
export RBD_NBD_GO_METRICS_ADDRESS=127.0.0.1:9190
scrape() { # scrape: the daemon's metrics, one series a line
	python3 -c 'import urllib.request; print(urllib.request.urlopen("http://127.0.0.1:9190/metrics", timeout=10).read().decode())'
}
series() { # series FILE NAME DEVICE [OP]: a device's counter in a scrape (0 if absent)
	awk -v n="$2" -v d="device=\"$3\"" -v o="op=\"${4:-}\"" \
		'index($0, n "{") == 1 && index($0, d) && (o == "op=\"\"" || index($0, o)) {v = $NF} END {printf "%d\n", v + 0}' "$1"
}

scenario_l() { # metrics and iostat: what fio did through /dev/nbd, a series gone at unmap
	local dev d
	check "map mem:256M, 2 connections" eval 'dev=$($B map --connections 2 mem:256M) && [ -b "$dev" ]'
	udevadm settle 2>/dev/null
	check "the daemon's metrics endpoint answers on loopback" eval 'scrape >$work/m0'
	# iodepth 1: the block layer merges nothing, so each fio I/O is one
	# NBD request.
	timeout 300 fio --name=w --filename="$dev" --direct=1 --ioengine=libaio --rw=randwrite --bs=4k --size=16M \
		--iodepth=1 --output-format=terse >"$work/fio-l1" 2>&1
	scrape >"$work/m1"
	timeout 300 fio --name=r --filename="$dev" --direct=1 --ioengine=libaio --rw=randread --bs=64k --size=16M \
		--iodepth=1 --output-format=terse >"$work/fio-l2" 2>&1
	scrape >"$work/m2"
	local w=$(( $(series $work/m1 rbd_nbd_requests_total $dev write) - $(series $work/m0 rbd_nbd_requests_total $dev write) ))
	local wb=$(( $(series $work/m1 rbd_nbd_bytes_total $dev write) - $(series $work/m0 rbd_nbd_bytes_total $dev write) ))
	local r=$(( $(series $work/m2 rbd_nbd_requests_total $dev read) - $(series $work/m1 rbd_nbd_requests_total $dev read) ))
	local rb=$(( $(series $work/m2 rbd_nbd_bytes_total $dev read) - $(series $work/m1 rbd_nbd_bytes_total $dev read) ))
	log "  fio 4096 writes of 4k, then 256 reads of 64k: the daemon counted $w writes ($wb bytes), $r reads ($rb bytes)"
	check "writes as fio did them (4096 within 1 %, 16 MiB exact)" eval '[ $w -ge 4055 ] && [ $w -le 4137 ] && [ $wb -eq 16777216 ]'
	check "reads as fio did them (256 within 1 %, 16 MiB exact)" eval '[ $r -ge 253 ] && [ $r -le 259 ] && [ $rb -eq 16777216 ]'
	check "backend latency histogram counts every write" eval '[ $(series $work/m1 rbd_nbd_request_backend_seconds_count $dev write) -eq $(series $work/m1 rbd_nbd_requests_total $dev write) ]'
	check "nothing in flight, both connections live" eval '[ $(series $work/m2 rbd_nbd_requests_in_flight $dev) -eq 0 ] && [ $(series $work/m2 rbd_nbd_connections $dev) -eq 2 ]'
	# iostat beside a fio of known rate: 100 writes/s for 12 s, read by
	# iostat from 1 s to 9 s in.
	timeout 60 fio --name=rate --filename="$dev" --direct=1 --ioengine=libaio --rw=randwrite --bs=4k --size=64M \
		--iodepth=4 --rate_iops=100 --time_based --runtime=12 --output-format=terse >"$work/fio-l3" 2>&1 &
	local fpid=$!
	sleep 1
	$B iostat "$dev" -i 2 --count 1 --format json >"$work/iostat-l.json"
	$B iostat "${dev#/dev/}" -i 2 --count 3 | tee "$work/iostat-l"
	wait $fpid
	check "iostat saw fio's 100 writes/s (90-110)" eval 'python3 -c "
import json; r=json.load(open(\"$work/iostat-l.json\"))[\"devices\"][0]
assert r[\"device\"]==\"$dev\" and 90 <= r[\"write\"][\"iops\"] <= 110, r"'
	check "iostat of a device not mapped: one line, exit non-zero" eval '! $B iostat /dev/nbd99 --count 1 2>$work/err && [ $(wc -l <$work/err) -eq 1 ]'
	check "unmap" $B unmap "$dev"
	check "the unmapped device's series are gone" eval 'scrape >$work/m3 && ! grep -q "device=\"$dev\"" $work/m3'
	# 9190 is 0x23E6; 0100007F is 127.0.0.1. Listening there, and on no
	# other address.
	check "the endpoint listens on loopback only" eval 'awk "\$4 == \"0A\"" /proc/net/tcp /proc/net/tcp6 | grep ":23E6 " >$work/l9190; grep -q "0100007F:23E6" $work/l9190 && [ $(wc -l <$work/l9190) -eq 1 ]'
	check "list-mapped is empty" no_devices
}

[ $# -gt 0 ] || set -- a b c d e f g h i j k l
for s in "$@"; do run_scenario "$s" "scenario_$s"; done
[ $cluster_up -eq 1 ] && scripts/ceph-dev-cluster stop "$work/ceph" >/dev/null 2>&1
pkill -f "$B daemon" 2>/dev/null
for r in "${recap[@]}"; do log "failed check: $r"; done
log "done: $fails failed ${failed[*]:-}"
exit $fails
