#!/bin/bash
# A single-node Kubernetes inside the VM: etcd (Debian), kube-apiserver,
# kube-controller-manager, kube-scheduler and kubelet (v1.36.1, built by
# e2e/k8s/build-tools.sh), containerd + runc (Debian), all on loopback.
# Sourced by e2e/k8s.sh after e2e/lib.sh. Facts behind the choices are in
# shared/notes/kubernetes.md.
#
# Networking without a network: the node's address is 192.0.2.1 (a
# documentation prefix) on lo, our pods use hostNetwork, and the
# `kubernetes` Service's ClusterIP 10.96.0.1 is put on lo too with the
# apiserver on :443, so in-cluster clients (the CSI sidecars) reach the
# API as on a real cluster, with no kube-proxy. Pods off the host network
# (Kubernetes' e2e suite makes only those) get a veth pair to the node
# (the ptp CNI plugin, 10.244.0.0/24) and one route beyond it: to
# 10.96.0.1, the node's own, so in-cluster clients among them (the
# suite's hello-populator) reach the API as the sidecars do.

K=/run/k8s
NODE=rbd-nbd-go-vm
NODE_IP=192.0.2.1
export KUBECONFIG=$K/admin.kubeconfig

k8s_pki() { # a CA, the apiserver's serving cert, one client cert per component, the SA key
	mkdir -p $K/pki && cd $K/pki || return 1
	local o="-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
	openssl req -x509 $o -keyout ca.key -out ca.crt -days 3 -subj /CN=e2e-ca 2>/dev/null || return 1
	cert() { # cert NAME SUBJECT [SAN]
		openssl req $o -keyout $1.key -out $1.csr -subj "$2" 2>/dev/null &&
			openssl x509 -req -in $1.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3 -out $1.crt \
				${3:+-extfile <(printf 'subjectAltName=%s\n' "$3")} 2>/dev/null
	}
	cert apiserver /CN=kube-apiserver \
		"IP:127.0.0.1,IP:10.96.0.1,IP:$NODE_IP,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local" &&
		cert admin "/O=system:masters/CN=e2e-admin" &&
		cert controller-manager /CN=system:kube-controller-manager &&
		cert scheduler /CN=system:kube-scheduler &&
		cert kubelet "/O=system:nodes/CN=system:node:$NODE" || return 1
	openssl ecparam -name prime256v1 -genkey -noout -out sa.key && openssl ec -in sa.key -pubout -out sa.pub 2>/dev/null || return 1
	for c in admin controller-manager scheduler kubelet; do
		cat >$K/$c.kubeconfig <<EOF
apiVersion: v1
kind: Config
clusters: [{name: e2e, cluster: {server: "https://127.0.0.1:443", certificate-authority: $K/pki/ca.crt}}]
users: [{name: $c, user: {client-certificate: $K/pki/$c.crt, client-key: $K/pki/$c.key}}]
contexts: [{name: e2e, context: {cluster: e2e, user: $c}}]
current-context: e2e
EOF
	done
	cd - >/dev/null
}

k8s_containerd() { # containerd with its root and state on tmpfs (an overlay upper layer cannot be on 9p)
	mkdir -p $K/containerd /run/cni/net.d
	# containerd adds the pod's lo itself; the sandbox must have an eth0
	# (veth: scripts/vm/vm.sh loads it).
	cat >/run/cni/net.d/10-pods.conflist <<'EOF'
{"cniVersion": "1.0.0", "name": "pods", "plugins": [{"type": "ptp", "ipMasq": false,
  "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.244.0.0/24"}]], "routes": [{"dst": "10.96.0.1/32"}],
    "dataDir": "/run/cni/ipam"}}]}
EOF
	cat >$K/containerd/config.toml <<'EOF'
version = 2
root = "/run/containerd-root"
state = "/run/containerd"
[grpc]
  address = "/run/containerd/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/pause:local"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "/run/cni/net.d"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
EOF
	containerd --config $K/containerd/config.toml >$LOGS/containerd.log 2>&1 &
}

k8s_kubelet() {
	mkdir -p /var/lib/kubelet
	cat >$K/kubelet.yaml <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
failSwapOn: false
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: $K/pki/ca.crt}
authorization: {mode: AlwaysAllow}
clusterDomain: cluster.local
resolvConf: ""
# The VM's root is a tmpfs overlay: no disk pressure evictions.
evictionHard: {memory.available: "50Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
# The kubelet's own status reports, often enough for a quick test.
nodeStatusUpdateFrequency: 5s
syncFrequency: 10s
EOF
	kubelet --config=$K/kubelet.yaml --kubeconfig=$K/kubelet.kubeconfig --hostname-override=$NODE \
		--node-ip=$NODE_IP --v=2 >$LOGS/kubelet.log 2>&1 &
}

# k8s_up IMAGES_DIR: the whole cluster, its containerd started from the
# root e2e/k8s/containerd-root.sh made of the images on the host; fails
# (with the component's log tail) if a step does not come up in time.
k8s_up() {
	local t0=$(date +%s.%N) tools
	tools=$(cd "$root" && e2e/k8s/build-tools.sh) || { log "  FAIL building the Kubernetes tools"; return 1; }
	export PATH=$tools/bin:$PATH
	LOGS=${E2E_OUT:-$work}/k8s-logs
	mkdir -p $K $LOGS
	ip addr add $NODE_IP/32 dev lo
	ip addr add 10.96.0.1/32 dev lo
	# What systemd does on a real node: shared mounts, so the node
	# plugin's Bidirectional mounts reach the kubelet; cgroup v2.
	mount --make-rshared /
	mkdir -p /sys/fs/cgroup && mount -t cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null
	echo "+cpu +cpuset +memory +pids +io" >/sys/fs/cgroup/cgroup.subtree_control 2>/dev/null
	k8s_pki || { log "  FAIL certificates"; return 1; }
	etcd --data-dir $K/etcd --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
		--listen-peer-urls http://127.0.0.1:2380 --unsafe-no-fsync >$LOGS/etcd.log 2>&1 &
	local p=$K/pki
	kube-apiserver --etcd-servers=http://127.0.0.1:2379 --bind-address=0.0.0.0 --secure-port=443 \
		--advertise-address=$NODE_IP --service-cluster-ip-range=10.96.0.0/16 \
		--tls-cert-file=$p/apiserver.crt --tls-private-key-file=$p/apiserver.key --client-ca-file=$p/ca.crt \
		--kubelet-client-certificate=$p/admin.crt --kubelet-client-key=$p/admin.key --kubelet-preferred-address-types=InternalIP \
		--service-account-issuer=https://kubernetes.default.svc.cluster.local \
		--service-account-key-file=$p/sa.pub --service-account-signing-key-file=$p/sa.key \
		--authorization-mode=Node,RBAC --allow-privileged=true --profiling=false \
		>$LOGS/kube-apiserver.log 2>&1 &
	# The images, imported on the host: a copy of their containerd root
	# takes seconds here, an import minutes (containerd-root.sh says why).
	local t1=$(date +%s.%N)
	[ -f "$1/containerd-root/io.containerd.metadata.v1.bolt/meta.db" ] ||
		{ log "  FAIL no containerd root in $1 (e2e/k8s/images.sh makes it)"; return 1; }
	mkdir -p /run/containerd-root && cp -a "$1/containerd-root/." /run/containerd-root/ ||
		{ log "  FAIL copying the containerd root"; return 1; }
	log "  images' containerd root copied in $(echo "$(date +%s.%N) - $t1" | bc)s"
	k8s_containerd
	k8s_wait 300 "the apiserver answers" kubectl get --raw /readyz || { tail -20 $LOGS/kube-apiserver.log; return 1; }
	kube-controller-manager --kubeconfig=$K/controller-manager.kubeconfig --leader-elect=false \
		--service-account-private-key-file=$p/sa.key --root-ca-file=$p/ca.crt \
		--use-service-account-credentials=true --profiling=false >$LOGS/kube-controller-manager.log 2>&1 &
	kube-scheduler --kubeconfig=$K/scheduler.kubeconfig --leader-elect=false --profiling=false >$LOGS/kube-scheduler.log 2>&1 &
	k8s_kubelet
	k8s_wait 300 "node $NODE is Ready" eval "kubectl get node $NODE -o jsonpath='{.status.conditions[?(@.type==\"Ready\")].status}' 2>/dev/null | grep -q True" ||
		{ tail -30 $LOGS/kubelet.log; return 1; }
	k8s_wait 120 "the default ServiceAccount exists" kubectl get serviceaccount default || return 1
	log "  cluster up in $(echo "$(date +%s.%N) - $t0" | bc)s"
}

k8s_wait() { # k8s_wait SECONDS WHAT COMMAND...: poll until COMMAND succeeds
	local limit=$1 what=$2 i; shift 2
	for ((i = 0; i < limit; i++)); do
		"$@" >/dev/null 2>&1 && return 0
		sleep 1
	done
	log "  timed out after ${limit}s: $what"
	return 1
}

k8s_down() { # stop everything; the VM is thrown away, so only what could hang poweroff
	pkill kubelet; pkill -f kube-; sleep 2
	pkill containerd-shim; pkill containerd; pkill etcd
}
