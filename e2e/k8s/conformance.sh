#!/bin/bash
# Kubernetes' own storage tests against the deployed driver: the
# External.Storage specs (k8s.io/kubernetes/test/e2e/storage/external at
# the version e2e/k8s/tools pins, in storage-e2e.test: the e2e suite with
# only those), driven by e2e/k8s/conformance/driver.yaml.
# Sourced by e2e/k8s.sh, after its deploy step.
#
#   conformance      the fixed subset below (make test)
#   conformance-all  every External.Storage spec but the skips (make
#                    e2e-k8s-conformance), or those E2E_CONFORMANCE_FOCUS
#                    matches
#
# ginkgo's JSON and JUnit reports go to $E2E_OUT/conformance/NAME; the
# Makefile turns the JSON into the dated table in bench/reference.

# Skipped by label, each for a reason docs/conformance.md gives:
# Disruptive specs restart the kubelet or the node, the VM's only one;
# Windows specs (ntfs) need a Windows node; SELinux needs an enforcing
# host. Everything else the driver does not claim, or that needs two
# nodes, the suite skips itself, with its reason in the report.
CONFORMANCE_SKIP='\[Disruptive\]|\[Feature:Windows\]|\[Feature:SELinux\]|\[Feature:SELinuxMountReadWriteOncePod'

# The subset: the three Kubernetes paths a user relies on most that no
# other make-test scenario drives through Kubernetes itself: a restore
# from a snapshot (the snapshot-controller and the snapshotter sidecar;
# its source's data written by one pod, snapshotted after that pod is
# gone and read by another: data kept across pods on ext4), a clone of
# a raw block volume, and a VolumeAttributesClass swapped on a mapped
# volume (the resizer's ModifyVolume). A spec runs 2 to 10 minutes in
# TCG, and the box's speed varies about four-fold, so make test keeps to
# these; the other specs (volumes should store data on ext4, xfs and
# block, snapshot fields, expansion, ReadWriteOncePod, a generic
# ephemeral volume) run in make e2e-k8s-conformance, and their driver
# paths in e2e-csi on real /dev/nbd.
CONFORMANCE_SUBSET=(
	'\[Testpattern: Dynamic PV \(default fs\)\] provisioning should provision storage with snapshot data source \[Feature'
	'\[Testpattern: Dynamic PV \(block volmode\)\] provisioning should provision storage with pvc data source$'
	'\[Testpattern: Dynamic PV \(block volmode\)\] volume-modify.*should modify volume that already has a VAC'
)

# conformance_run NAME FOCUS PROCS SECONDS: ginkgo runs the suite's specs
# matching FOCUS (within External.Storage for this driver), PROCS at once;
# fails if any spec fails. Prints the counts ginkgo ends with.
conformance_run() {
	local name=$1 focus=$2 procs=$3 limit=$4 out rc copier
	out=${E2E_OUT:-$work}/conformance/$name
	rm -rf "$out" && mkdir -p "$out" /run/e2e-conformance
	# The suite takes a VolumeAttributesClass file of exactly one object:
	# the example's first (silver).
	awk '/^---/ {exit} {print}' "$root/deploy/kubernetes/examples/volumeattributesclass.yaml" \
		>/run/e2e-conformance/volumeattributesclass.yaml
	# The suite reads some of the files it names from its working
	# directory (ginkgo's: the test binary's own), the rest under -repo-root:
	# both work when the paths are absolute.
	sed -E "s|^( *FromFile: )([^/])|\1$root/\2|" "$root/e2e/k8s/conformance/driver.yaml" >/run/e2e-conformance/driver.yaml
	log "    ginkgo -p $procs, focus: $focus"
	# The suite's own controller pods are gone with their namespaces when
	# a spec ends: their logs (hello-populator's, its populate pods') are
	# copied while it runs, to explain a failure.
	(while sleep 10; do
		for f in /var/log/pods/*_hello-populator-*/*/*.log /var/log/pods/*_populate-*/*/*.log; do
			[ -f "$f" ] && cp "$f" "$out/suite-pod-$(basename "$(dirname "$(dirname "$f")")" | cut -d_ -f2).log"
		done
	done) &
	local copier=$!
	# ginkgo's own timeout first, so it still writes its reports; ours
	# only if it hangs past that.
	(cd "$root" && timeout -k 30 "$((limit + 300))" ginkgo --procs="$procs" --no-color --timeout="${limit}s" --poll-progress-after=10m \
		--focus="External.Storage \[Driver: $DRIVER\].*($focus)" --skip="$CONFORMANCE_SKIP" \
		--json-report=report.json --junit-report=junit.xml --output-dir="$out" \
		"$(command -v storage-e2e.test)" -- \
		-kubeconfig="$KUBECONFIG" -storage.testdriver=/run/e2e-conformance/driver.yaml -repo-root="$root" \
		-node-os-distro=debian >"$out/ginkgo.log" 2>&1)
	rc=$?
	kill $copier 2>/dev/null
	# For explaining a failure: the daemon's log and the kernel's (nbd's
	# own messages), and every container log of the driver's pods, the
	# ones before each restart included (the kubelet's N.log files).
	cp /run/rbd-nbd-go/daemon.log "$out/" 2>/dev/null
	dmesg >"$out/dmesg.txt" 2>/dev/null
	local f
	for f in /var/log/pods/${NS}_rbd-nbd-go-*/*/*.log; do
		[ -f "$f" ] && cp "$f" "$out/pod-$(basename "$(dirname "$(dirname "$f")")" | cut -d_ -f2)-$(basename "$(dirname "$f")")-$(basename "$f")"
	done
	grep -E '^Ran [0-9]+ of|Passed \|' "$out/ginkgo.log" | tail -2 | while read -r l; do log "    $l"; done
	if [ $rc -ne 0 ]; then
		{
			echo "ginkgo exit $rc;"
			grep -E '^\s*\[(FAIL|TIMEDOUT|PANICKED|INTERRUPTED)\]' "$out/ginkgo.log" | sort -u | head -5
		} >"$work/why"
		return 1
	fi
}

# left_behind SECONDS: until the pool holds no image or trash entry and no
# /dev/nbd is served; what is left into $work/why.
left_behind() {
	k8s_wait "$1" "the suite's volumes gone from the pool" pool_clean
	no_nbd_in_use || return 1
	pool_clean && return 0
	echo "left in the pool: $(rbd ls rbd | tr '\n' ' ') trash: $(rbd trash ls rbd | tr '\n' ' ')" >"$work/why"
	return 1
}

scenario_conformance() {
	local focus
	focus=$(IFS='|'; echo "${CONFORMANCE_SUBSET[*]}")
	# Four specs, three at a time: the longest is about 10 minutes on a
	# slow day (bench/reference/conformance). The bound only caps a hang,
	# inside make test's VM timeout (a device that hangs ends the VM
	# sooner: e2e/lib.sh).
	check "Kubernetes' storage tests, the subset: ${#CONFORMANCE_SUBSET[@]} specs pass" conformance_run subset "$focus" 3 1800
	check "nothing left behind: no image, trash entry or mapped device" left_behind 300
}
scenario_conformance-all() {
	# E2E_CONFORMANCE_FOCUS narrows it, to run some specs again (report
	# in conformance/focus).
	# E2E_CONFORMANCE_SECONDS bounds the run (4 h unless set): ginkgo
	# stops there and reports what ran.
	local focus=${E2E_CONFORMANCE_FOCUS:-.*} name=all
	[ "$focus" = '.*' ] || name=focus
	check "Kubernetes' storage tests, all of External.Storage but the skips, pass" \
		conformance_run "$name" "$focus" 3 "${E2E_CONFORMANCE_SECONDS:-14400}"
	# The retain-policy specs leave their snapshots in Ceph by design,
	# so this run only says what is left.
	k8s_wait 300 "the suite's volumes gone from the pool" pool_clean ||
		log "    left in the pool: $(rbd ls rbd | wc -l) images, $(rbd trash ls rbd | wc -l) in the trash"
}
