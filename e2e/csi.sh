#!/bin/bash
# CSI scenarios, run inside the VM (scripts/vm/vm.sh) as root:
#   e2e/csi.sh [go] [dropin] [soak] [timing]    (default: the first three)
# go:     the Go tests of csi/conformance on real /dev/nbd, real mkfs and
#         mounts: upstream csi-sanity v5.6.0 (its node and identity
#         specs, mount and block; the host ran the controller half), a
#         volume's life as Kubernetes plays it, Retain and a
#         static volume, online expand of ext4 and xfs under fio verify,
#         restart survival (SIGKILL and SIGTERM) and an upgrade's daemon
#         handover (the plugins overlapping) under fio verify, bad
#         input, snapshots, restores and clones of mounted volumes (data
#         byte for byte, the freeze, every delete order), and a QoS limit
#         changed live under fio (ControllerModifyVolume). Uses
#         bin/csi-conformance.test (make builds it).
# timing: stage/unstage and snapshot/restore times beside ceph-csi's
#         commands, in the same run (make bench-vm-csi; not in make test:
#         times are a benchmark's, not a test's).
# dropin: ceph-csi's whole call sequence with our binary installed as
#         rbd-nbd: its start-up probe, then map/list/unmap through Ceph's
#         rbd CLI (ceph-csi < 3.11) and directly (3.11+), attach after a
#         daemon kill (the healer), and the "not mapped" words.
. "$(dirname "$0")/lib.sh"
T=$root/bin/csi-conformance.test

# Tests the go scenario leaves out when the soak runs too: TestRestartSurvival
# (a kill -9 and a SIGTERM of the plugin under fio verify) is what the soak
# does to eight volumes, with the stalls in its table; and the timing
# scenario's tests.
timing_tests='TestStageTimeVsCephCSI|TestSnapshotTimeVsCephCSI'
go_skip=${E2E_GO_SKIP-}
# go_tests OUT SECONDS TESTS ARGS...: the conformance binary with ARGS,
# its whole output kept in OUT (in the shared results directory, if
# any); prints what the note reports (sanity's counts, the times, the
# stalls) and checks that each of TESTS (a |-list) but the skipped ones
# passed and that the binary exited 0.
go_tests() {
	local out=$1 secs=$2 tests=$3 rc tst
	shift 3
	(cd "$root/csi/conformance" && RBD_NBD_GO_BIN=$B RBD_NBD_GO_CSI_NODE=1 RBD_NBD_GO_CEPH=required \
		timeout -k 10 "$secs" "$T" -test.v -test.count=1 -test.timeout $((secs / 60 - 2))m "$@") >"$out" 2>&1
	rc=$?
	sed 's/\x1b\[[0-9;]*m//g' "$out" | grep -aE '^(Ran |SUCCESS|FAIL!)|took|longest|fio measured|grew online|plugin back|upgrade:|first stage|second stage|snapshot of a mounted|restore to|pool and trash|^\s*(--- |ok|FAIL)' |
		sed 's/^/e2e:   /'
	for tst in ${tests//|/ }; do
		[[ $tst =~ ^($go_skip)$ ]] && continue
		check "$tst" grep -q "^--- PASS: $tst " "$out"
	done
	check "the conformance binary exited 0" test $rc -eq 0
	[ $rc -eq 0 ] || sed 's/\x1b\[[0-9;]*m//g' "$out" | grep -aB2 -A12 '\[FAIL\]\|--- FAIL' | tail -80
}

scenario_go() {
	go_tests "${E2E_OUT:-$work}/conformance.out" 2400 "TestSanity|TestVolumeLifecycle|TestRetainAndStaticVolume|TestOnlineExpand|\
TestRestartSurvival|TestUpgradeHandover|TestBadInput|$timing_tests|TestSnapshotRestoreCloneMounted|TestQoSLiveModify|\
TestEncryptedVolume|TestCephCSIEncryptedVolumeOpens|TestRestoreChainDepth" -test.skip "$go_skip"
}

# soak: the chaos soak (TestChaosSoak) for E2E_SOAK_MIN minutes (5 in
# make test, 30 in make soak): eight volumes under fio verify and an
# fsync'd append log while the plugin, its daemon and the OSD are
# killed, upgraded and cut off. Its report goes to $E2E_OUT/soak.md.
scenario_soak() {
	local m min=${E2E_SOAK_MIN:-5} out=${E2E_OUT:-$work}/soak.out rc
	for m in x_tables ip_tables iptable_filter xt_tcpudp; do
		busybox insmod "$(find /lib/modules/$(uname -r)/kernel/net -name $m.ko | head -1)" 2>/dev/null
	done
	# The OSD runs on bluestore (a killed memstore OSD loses everything),
	# which opens its block file O_DIRECT: tmpfs has no O_DIRECT on this
	# kernel, so the test's temporary files live on an ext4 loop device.
	local fs=$work/soakfs
	mkdir -p "$fs" && truncate -s 16G "$work/soakfs.img" && mkfs.ext4 -q -E nodiscard "$work/soakfs.img" &&
		mount -o loop "$work/soakfs.img" "$fs" || { fail_check "an ext4 loop device for the soak's files"; return; }
	# Faults go on past the duration until each kind has come up, for up
	# to twice it; set-up and teardown take a few minutes under TCG.
	(cd "$root/csi/conformance" && RBD_NBD_GO_BIN=$B RBD_NBD_GO_CSI_NODE=1 RBD_NBD_GO_CEPH=required \
		RBD_NBD_GO_SOAK=${min}m RBD_NBD_GO_SOAK_REPORT=${E2E_OUT:-$work}/soak.md \
		RBD_NBD_GO_SOAK_LOGS=${E2E_OUT:-$work}/soak-logs TMPDIR=$fs \
		timeout -k 10 $(((2 * min + 15) * 60)) "$T" -test.run '^TestChaosSoak$' -test.v -test.count=1 \
		-test.timeout $((2 * min + 14))m) >"$out" 2>&1
	rc=$?
	umount "$fs"
	sed -i 's/\x1b\[[0-9;]*m//g' "$out"
	grep -aE 'soak:|^\s*\||seed' "$out" | sed 's/^/e2e:   /'
	check "TestChaosSoak" grep -q "^--- PASS: TestChaosSoak " "$out"
	if [ $rc -ne 0 ]; then
		# What failed (t.Errorf's lines; the summary above keeps only
		# the soak's own), then the end of the output: the logs.
		grep -aE '^\s+[a-z_]+_test\.go:[0-9]+: ' "$out" | grep -avE '_test\.go:[0-9]+: (soak: |soak report:|Node[A-Za-z]+ took )' |
			head -40 | sed 's/^/e2e: failed: /'
		tail -60 "$out"
	fi
}

# timing: NodeStage/NodeUnstage and a snapshot and restore of a mounted
# volume, each beside the commands ceph-csi runs for the same steps.
scenario_timing() {
	go_tests "${E2E_OUT:-$work}/timing.out" 1200 "$timing_tests" -test.run "^($timing_tests)\$"
}

probe() { # ceph-csi's probe of rbd-nbd: exit 0, empty stderr, --cookie on stdout
	local out
	out=$(rbd-nbd --help 2>"$work/probe.err") || return 1
	[ ! -s "$work/probe.err" ] && grep -q -- '--cookie' <<<"$out"
}

scenario_dropin() {
	cluster || return
	rbd create --size 128M rbd/vol-p
	check "Ceph's own rbd-nbd passes ceph-csi's probe (reference)" probe
	cp /usr/bin/rbd-nbd "$work/rbd-nbd.ceph"
	cp "$B" /usr/bin/rbd-nbd # the VM's overlay: gone with the VM
	check "ours, installed as rbd-nbd, passes it too" probe
	local dev k=(--id admin -m "$mon" --keyfile="$work/admin.key")
	# ceph-csi before 3.11: through the rbd CLI, which runs rbd-nbd from
	# its own directory with -o turned into --options.
	check "rbd map --device-type nbd, ceph-csi's options" eval 'dev=$(rbd "${k[@]}" --log-file "$work/p.log" map rbd/vol-p --device-type nbd --options try-netlink --options reattach-timeout=300 --options io-timeout=0 --options cookie=vol-p) && [ -b "$dev" ]'
	check "rbd device list --format=json --device-type nbd lists it" eval 'rbd device list --format=json --device-type nbd | python3 -c "import json,sys; d=json.load(sys.stdin); sys.exit(not any(x[\"image\"]==\"vol-p\" and x[\"pool\"]==\"rbd\" and x[\"device\"]==\"$dev\" and isinstance(x[\"id\"], int) for x in d))"'
	check "mkfs and write through it" eval 'mkfs.ext4 -q -F $dev && mkdir -p $work/p && mount $dev $work/p && echo kept > $work/p/f && umount $work/p'
	check "rbd unmap --device-type nbd" rbd unmap rbd/vol-p --device-type nbd
	check "a second unmap says ceph-csi's 'not mapped' words" eval '! rbd unmap rbd/vol-p --device-type nbd 2>$work/un.err && grep -q "rbd-nbd: rbd/vol-p is not mapped" $work/un.err'
	# ceph-csi 3.11+: rbd-nbd directly.
	check "rbd-nbd map, ceph-csi's command line" eval 'dev=$(rbd-nbd "${k[@]}" --log-file "$work/p.log" map rbd/vol-p --try-netlink --reattach-timeout=300 --io-timeout=0 --cookie=vol-p) && [ -b "$dev" ]'
	check "rbd-nbd list-mapped --format=json" eval 'rbd-nbd list-mapped --format=json | grep -q "\"device\":\"$dev\""'
	check "the data is there" eval 'mount $dev $work/p && grep -q kept $work/p/f'
	local pid=$(cat /run/rbd-nbd-go/daemon.lock)
	kill -9 "$pid"
	check "the healer's attach after the server died" rbd-nbd "${k[@]}" --log-file "$work/p.log" attach rbd/vol-p --device "$dev" --try-netlink --reattach-timeout=300 --io-timeout=0 --cookie=vol-p
	check "the mounted filesystem still writes" eval 'echo more >> $work/p/f && sync -f $work/p/f'
	umount "$work/p"
	check "rbd-nbd unmap by device" rbd-nbd unmap "$dev"
	check "a second unmap: 'rbd-nbd: $dev is not mapped' on stderr" eval '! rbd-nbd unmap $dev 2>$work/un.err && grep -q "rbd-nbd: $dev is not mapped" $work/un.err'
	pkill -f "rbd-nbd daemon"; sleep 1 # the daemon runs from /usr/bin/rbd-nbd
	cp "$work/rbd-nbd.ceph" /usr/bin/rbd-nbd
	check "no device left behind" no_devices
}

if [ $# -eq 0 ]; then
	set -- go dropin soak
	go_skip=${E2E_GO_SKIP-TestRestartSurvival|$timing_tests}
fi
for s in "$@"; do run_scenario "$s" "scenario_$s"; done
[ $cluster_up -eq 1 ] && scripts/ceph-dev-cluster stop "$work/ceph" >/dev/null 2>&1
pkill -f "$B daemon" 2>/dev/null
pkill -f "rbd-nbd daemon" 2>/dev/null
for r in "${recap[@]}"; do log "failed check: $r"; done
log "done: $fails failed ${failed[*]:-}"
exit $fails
