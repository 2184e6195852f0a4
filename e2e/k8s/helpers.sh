#!/bin/bash
# e2e/k8s.sh's helpers: kubectl lookups and waits, PVCs and pods of the
# scenarios, events, and the node plugin's metrics. Sourced by e2e/k8s.sh.

jp() { # jp KIND [NAMESPACE/]NAME JSONPATH
	local ns=default n=$2
	[[ $n == */* ]] && ns=${n%%/*} n=${n#*/}
	# A bound on each GET: a wedged apiserver fails the wait, not the run.
	kubectl -n "$ns" get "$1" "$n" -o jsonpath="$3" --request-timeout=30s 2>/dev/null
}
on_scenario_fail() { # the controller pod's containers (driver and sidecars) and recent events
	local f
	# From the files the kubelet writes: no apiserver round trip, and
	# still there when the apiserver is what failed.
	for f in /var/log/pods/${NS}_rbd-nbd-go-controller-*/*/*.log; do
		[ -f "$f" ] && { echo "== $f"; tail -30 "$f"; }
	done
	timeout 60 kubectl get events -A --sort-by=.lastTimestamp --request-timeout=30s 2>&1 | tail -25
}
wait_jp() { # wait_jp SECONDS KIND NAME JSONPATH REGEX: until the field matches
	local limit=$1 kind=$2 name=$3 path=$4 want=$5 i v
	for ((i = 0; i < limit; i++)); do
		v=$(jp "$kind" "$name" "$path")
		[[ $v =~ $want ]] && return 0
		sleep 1
	done
	echo "$kind/$name $path = '$v', want /$want/" >"$work/why"
	return 1
}
gone() { # gone SECONDS KIND NAME
	local i
	for ((i = 0; i < $1; i++)); do
		# Gone is NotFound, not any failure (a timed-out GET says
		# nothing). Not a pipe into grep: with pipefail, kubectl's own
		# failure would fail the pipe.
		[[ $(kubectl get "$2" "$3" --request-timeout=30s 2>&1 >/dev/null) == *NotFound* ]] && return 0
		sleep 1
	done
	echo "$2/$3 still there after $1 s" >"$work/why"
	return 1
}
image_exists() { rbd ls rbd 2>/dev/null | grep -qx "$1"; }
pv_image() { jp pv "$1" '{.spec.csi.volumeHandle}' | awk -F/ '{print $NF}'; } # nbd1/CLUSTER/POOL/NS/IMAGE
pvc() { # pvc NAME SIZE CLASS [Block]
	kubectl apply -f - >/dev/null <<EOF
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: $1}
spec:
  accessModes: [ReadWriteOnce]
  ${4:+volumeMode: $4}
  storageClassName: "$3"
  resources: {requests: {storage: $2}}
EOF
}
pod() { # pod NAME PVC SCRIPT [block]: one container running SCRIPT with the volume at /data (or /dev/xvda)
	local vol="volumeMounts: [{name: v, mountPath: /data}]"
	[ "${4:-}" = block ] && vol="volumeDevices: [{name: v, devicePath: /dev/xvda}]"
	kubectl apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: $1}
spec:
  hostNetwork: true
  restartPolicy: Never
  terminationGracePeriodSeconds: 5
  containers:
    - name: app
      image: $APP
      imagePullPolicy: Never
      command: [sh, -c, $(printf '%s' "$3" | python3 -c 'import json,sys; print(json.dumps(sys.stdin.read()))')]
      $vol
  volumes: [{name: v, persistentVolumeClaim: {claimName: $2}}]
EOF
}
pod_done() { # pod_done SECONDS NAME: the pod ran to Succeeded; its termination message into $work/msg
	local st
	wait_jp "$1" pod "$2" '{.status.phase}' '^(Succeeded|Failed)$' || { pod_events "$2"; return 1; }
	jp pod "$2" '{.status.containerStatuses[0].state.terminated.message}' >"$work/msg"
	st=$(jp pod "$2" '{.status.phase}')
	[ "$st" = Succeeded ] || { echo "pod $2 $st: $(tail -c 300 "$work/msg")" >"$work/why"; return 1; }
}
pod_events() { kubectl get events --field-selector involvedObject.name="$1" -o custom-columns=R:.reason,M:.message --no-headers 2>/dev/null | tail -5; }
has_event() { # has_event SECONDS NAME REASON REGEX: an event on object NAME
	local i
	for ((i = 0; i < $1; i++)); do
		kubectl get events --request-timeout=30s --field-selector involvedObject.name="$2",reason="$3" -o jsonpath='{range .items[*]}{.message}{"\n"}{end}' 2>/dev/null >"$work/ev"
		grep -qE "$4" "$work/ev" && { log "    event $3: $(grep -E "$4" "$work/ev" | head -1 | cut -c1-200)"; return 0; }
		sleep 1
	done
	{ echo "no $3 event matching /$4/ on $2; events:"; pod_events "$2"; } >"$work/why"
	return 1
}
secs_between() { echo $(($(date -d "$2" +%s) - $(date -d "$1" +%s))); } # two RFC 3339 times
no_nbd_in_use() { for p in /sys/block/nbd*/pid; do [ -e "$p" ] && { echo "$p still served" >"$work/why"; return 1; }; done; return 0; }
node_pod() { kubectl -n $NS get pod -l app=rbd-nbd-go-node -o jsonpath='{.items[0].metadata.name}'; }

# --- metrics of the node plugin (deploy/kubernetes: on the node's address)
scrape_url() { python3 -c 'import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())' "$1"; }
image_writes() { # image_writes FILE IMAGE: the write requests a scrape counts for IMAGE
	awk -v i="image=\"$2\"" 'index($0, "rbd_nbd_requests_total{") == 1 && index($0, i) && index($0, "op=\"write\"") {v = $NF} END {printf "%d\n", v + 0}' "$1"
}
metrics_rate() { # metrics_rate IP IMAGE: the daemon's metrics show IMAGE written, at a non-zero rate
	local a b t0 ms
	t0=$(date +%s%N)
	scrape_url "http://$1:9190/metrics" >"$work/ma" || { echo "no device metrics at $1:9190" >"$work/why"; return 1; }
	sleep 4
	scrape_url "http://$1:9190/metrics" >"$work/mb" || return 1
	ms=$((($(date +%s%N) - t0) / 1000000))
	a=$(image_writes "$work/ma" "$2") b=$(image_writes "$work/mb" "$2")
	log "    the node's device metrics: $2 written $(((b - a) * 1000 / ms)) times a second ($a, then $b, $ms ms apart at most)"
	[ $((b - a)) -gt 40 ] || { echo "writes of $2: $a, then $b 4 s later" >"$work/why"; return 1; }
}

# Scenario i's fio readings.
fio_rate() { # fio_rate POD FROM_MS: write IOPS of POD's fio (terse status lines, cumulative) from its runtime FROM_MS to the last line; and that runtime
	awk -F';' -v from="$2" '/ F 3;fio-/ && $50 > 0 {
			if (!t0 && $50 >= from) { t0 = $50; k0 = $47 }
			t = $50; k = $47
		}
		END { if (t0 && t > t0) printf "%.1f %d\n", (k - k0) / 4 / ((t - t0) / 1000), t; else print "0 " t + 0 }' \
		/var/log/pods/default_"$1"_*/app/*.log 2>/dev/null
}
fio_at() { # fio_at POD MS: until fio in POD has run MS
	k8s_wait 300 "fio ran $2 ms" eval "[ \$(fio_rate $1 0 | cut -d' ' -f2) -ge $2 ]" ||
		{ echo "fio at $(fio_rate "$1" 0 | cut -d' ' -f2) ms" >"$work/why"; return 1; }
}
within() { # within RATE LIMIT LOW HIGH: RATE is LOW to HIGH % of LIMIT
	awk -v r="$1" -v l="$2" -v lo="$3" -v hi="$4" 'BEGIN {exit !(r >= l * lo / 100 && r <= l * hi / 100)}' ||
		{ echo "$1 IOPS, limit $2" >"$work/why"; return 1; }
}
scenario_rbac() { check "no component was refused by RBAC (no 'forbidden' in their logs)" rbac_clean; }
rbac_clean() { # the driver's pods logged no request RBAC forbade
	local o
	for o in deploy/rbd-nbd-go-controller deploy/rbd-nbd-go-snapshot-controller ds/rbd-nbd-go-node; do
		kubectl -n $NS logs $o --all-containers --request-timeout=60s 2>&1
	done | grep -m3 -i forbidden >"$work/why" && return 1
	: >"$work/why"
}
