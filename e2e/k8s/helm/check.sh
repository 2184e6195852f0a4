#!/bin/bash
# Check the Helm chart against the kustomization it mirrors:
#   1. `helm lint` passes, with the default values and with check values;
#   2. with the default values, `helm template rbd-nbd-go CHART
#      --namespace rbd-nbd-go --include-crds` renders the same objects as
#      `kubectl kustomize KUSTOMIZE_DIR` (parsed, as sets keyed by
#      kind/namespace/name; every difference is printed);
#   3. with non-default values (StorageClass and Secret created, one
#      cluster of our own in csiConfig, no snapshot-controller, metrics
#      off) the rendering holds what those values say;
#   4. the StorageClass, VolumeSnapshotClass and Secret the chart renders
#      on request equal KUSTOMIZE_DIR/examples' storageclass-ext4.yaml,
#      snapshotclass.yaml and secret.yaml.
# Exits non-zero on any failure.
#
#   e2e/k8s/helm/check.sh deploy/helm/rbd-nbd-go deploy/kubernetes
#
# helm: $HELM, else this directory's pinned one (build.sh, cached).
# kubectl: $KUBECTL, else e2e/k8s/build-tools.sh's pinned one if it is in
# its cache (${K8S_TOOLS_CACHE:-/var/cache/rbd-nbd-go-k8s}), else one on
# PATH, else any of that cache; none is built here.
# Needs python3; PyYAML if it has it, else helm itself turns YAML into
# JSON for the comparison.
set -euo pipefail

if [ $# -ne 2 ]; then
	echo "usage: $0 CHART_DIR KUSTOMIZE_DIR" >&2
	exit 2
fi
chart=$(cd "$1" && pwd)
kdir=$(cd "$2" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
release=rbd-nbd-go
ns=rbd-nbd-go

helm=${HELM:-$("$here/build.sh")}
# kubectl: $KUBECTL, else the pinned one of e2e/k8s/tools if built, else
# one on PATH, else the newest of the tools cache.
kubectl=${KUBECTL:-}
cache=${K8S_TOOLS_CACHE:-/var/cache/rbd-nbd-go-k8s}
tools=$here/../tools
if [ -z "$kubectl" ]; then
	hash=$(cat "$tools/go.mod" "$tools/go.sum" 2>/dev/null | sha256sum | cut -c1-16)
	if [ -x "$cache/$hash/bin/kubectl" ]; then
		kubectl=$cache/$hash/bin/kubectl
	fi
fi
[ -n "$kubectl" ] || kubectl=$(command -v kubectl || true)
[ -n "$kubectl" ] || kubectl=$(ls -t "$cache"/*/bin/kubectl 2>/dev/null | head -1 || true)
if [ -z "$kubectl" ] || [ ! -x "$kubectl" ]; then
	echo "check: no kubectl: set KUBECTL, put one on PATH or run e2e/k8s/build-tools.sh" >&2
	exit 2
fi
command -v python3 >/dev/null || { echo "check: python3 is needed" >&2; exit 2; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failed=0
pass() { echo "ok   $*"; }
fail() { echo "FAIL $*"; failed=1; }

echo "helm:    $helm ($("$helm" version --template '{{.Version}}'))"
echo "kubectl: $kubectl"

# The non-default values of step 3.
cat >"$tmp/check-values.yaml" <<'EOF'
csiConfig:
  - clusterID: check-cluster
    monitors: ["198.51.100.1:6789", "198.51.100.2:3300"]
    rbd: {radosNamespace: check-ns}
storageClass: {create: true, clusterID: check-cluster, pool: check-pool}
secret: {create: true, userID: check-user, userKey: AQDcheckcheckcheckcheckcheckcheckcheck==}
snapshotController: {enabled: false}
nodeplugin: {httpMetrics: {enabled: false}, deviceMetrics: {enabled: false}}
provisioner: {httpMetrics: {enabled: false}}
EOF

# 1. lint
for v in default check; do
	args=()
	[ $v = check ] && args=(-f "$tmp/check-values.yaml")
	if "$helm" lint --strict --namespace "$ns" "${args[@]}" "$chart" >"$tmp/lint-$v.out" 2>&1; then
		pass "helm lint --strict, $v values"
	else
		fail "helm lint --strict, $v values:"
		sed 's/^/     /' "$tmp/lint-$v.out"
	fi
done

# The renderings: 2's, the chart's defaults and the kustomization;
"$helm" template "$release" "$chart" --namespace "$ns" --include-crds >"$tmp/helm.yaml"
"$kubectl" kustomize "$kdir" >"$tmp/kustomize.yaml"
# 3's;
"$helm" template "$release" "$chart" --namespace "$ns" --include-crds -f "$tmp/check-values.yaml" >"$tmp/check.yaml"
# 4's: the examples' classes and Secret (its placeholder key).
"$helm" template "$release" "$chart" --namespace "$ns" --set storageClass.create=true \
	--set volumeSnapshotClass.create=true --set secret.create=true --set 'secret.userKey=AQD...your key...==' \
	--show-only templates/storageclass.yaml --show-only templates/snapshotclass.yaml \
	--show-only templates/secret.yaml >"$tmp/classes.yaml"
examples=(storageclass-ext4.yaml snapshotclass.yaml secret.yaml)
for e in "${examples[@]}"; do
	[ -f "$kdir/examples/$e" ] || { echo "check: no $kdir/examples/$e" >&2; exit 2; }
	printf -- '---\n' >>"$tmp/examples.yaml"
	cat "$kdir/examples/$e" >>"$tmp/examples.yaml"
done

# Every rendering as one JSON array of its objects, in $tmp/*.json.
if python3 -c 'import yaml' 2>/dev/null; then
	for f in helm kustomize check classes examples; do
		python3 - "$tmp/$f.yaml" "$tmp/$f.json" <<'PY'
import json, sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d is not None]
json.dump(docs, open(sys.argv[2], "w"))
PY
	done
else
	echo "check: python3 has no PyYAML: helm turns the YAML into JSON"
	# A scratch chart whose template reads a file, splits its documents
	# and prints each as JSON (itself valid YAML), one a line.
	mkdir -p "$tmp/y2j/templates"
	printf 'apiVersion: v2\nname: y2j\nversion: 0.0.0\n' >"$tmp/y2j/Chart.yaml"
	cat >"$tmp/y2j/templates/docs.yaml" <<'EOF'
{{- range regexSplit "(?m)^---.*$" (.Files.Get "in.yaml") -1 }}
{{- $o := fromYaml . }}
{{- if hasKey $o "Error" }}{{ fail (printf "YAML: %s" $o.Error) }}{{ end }}
{{- if $o }}
---
{{ toJson $o }}
{{- end }}
{{- end }}
EOF
	for f in helm kustomize check classes examples; do
		cp "$tmp/$f.yaml" "$tmp/y2j/in.yaml"
		"$helm" template y2j "$tmp/y2j" >"$tmp/$f.lines"
		python3 - "$tmp/$f.lines" "$tmp/$f.json" <<'PY'
import json, sys
docs = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
json.dump(docs, open(sys.argv[2], "w"))
PY
	done
fi

cat >"$tmp/compare.py" <<'PY'
# compare.py WANT.json GOT.json WANT-NAME: the objects of two renderings,
# as sets keyed by kind/namespace/name; prints every difference.
import difflib, json, sys

def objects(path):
    out = {}
    for o in json.load(open(path)):
        m = o.get("metadata") or {}
        key = (o.get("kind", "?"), m.get("namespace", ""), m.get("name", "?"))
        if key in out:
            print(f"     {path}: {'/'.join(key)} twice")
            sys.exit(1)
        out[key] = o
    return out

want, got = objects(sys.argv[1]), objects(sys.argv[2])
if not want:
    print(f"     nothing from {sys.argv[3]}")
    sys.exit(1)
bad = False
for key in sorted(set(want) | set(got)):
    name = "/".join(k for k in key if k)
    if key not in got:
        print(f"     missing from the chart: {name}")
        bad = True
    elif key not in want:
        print(f"     only in the chart: {name}")
        bad = True
    elif want[key] != got[key]:
        print(f"     differs: {name} (- {sys.argv[3]}, + chart)")
        a = json.dumps(want[key], indent=2, sort_keys=True).splitlines()
        b = json.dumps(got[key], indent=2, sort_keys=True).splitlines()
        for line in difflib.unified_diff(a, b, sys.argv[3], "chart", n=2, lineterm=""):
            print("       " + line)
        bad = True
print(f"     {len(want)} objects from {sys.argv[3]}, {len(got)} from helm template")
sys.exit(bad)
PY
# 2. the default rendering against the kustomization
if python3 "$tmp/compare.py" "$tmp/kustomize.json" "$tmp/helm.json" "kubectl kustomize"; then
	pass "helm template (defaults, --include-crds) = kubectl kustomize $2"
else
	fail "helm template (defaults, --include-crds) != kubectl kustomize $2"
fi

# 3. the non-default values
if python3 - "$tmp/check.json" "$ns" <<'PY'; then
import json, sys

docs, ns = json.load(open(sys.argv[1])), sys.argv[2]
bad = []
def by(kind, name):
    return [o for o in docs if o["kind"] == kind and o["metadata"]["name"] == name]
def check(ok, what):
    print(f"     {'ok  ' if ok else 'FAIL'} {what}")
    if not ok:
        bad.append(what)

sc = by("StorageClass", "rbd-nbd-go-ext4")
check(len(sc) == 1, "a StorageClass rbd-nbd-go-ext4")
if sc:
    p = sc[0]["parameters"]
    check(sc[0]["provisioner"] == "rbd-nbd-go.csi.io", "... provisioner rbd-nbd-go.csi.io")
    check(p.get("clusterID") == "check-cluster" and p.get("pool") == "check-pool", "... clusterID and pool from the values")
    check(p.get("csi.storage.k8s.io/node-stage-secret-name") == "csi-rbd-secret"
          and p.get("csi.storage.k8s.io/node-stage-secret-namespace") == ns, "... the Secret csi-rbd-secret in the release namespace")

sec = by("Secret", "csi-rbd-secret")
check(len(sec) == 1 and sec[0]["metadata"].get("namespace") == ns, "a Secret csi-rbd-secret in the release namespace")
if sec:
    d = sec[0].get("stringData", {})
    check(d.get("userID") == "check-user" and d.get("userKey") == "AQDcheckcheckcheckcheckcheckcheckcheck==",
          "... userID and userKey from the values")

snap = [f"{o['kind']}/{o['metadata']['name']}" for o in docs
        if "snapshot-controller" in o["metadata"]["name"]
        or any(c.get("name") == "snapshot-controller"
               for c in o.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []))]
check(not snap, "no snapshot-controller objects" + (f" (found {', '.join(snap)})" if snap else ""))

metrics = []
for o in docs:
    for c in o.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
        where = f"{o['kind']}/{o['metadata']['name']}:{c['name']}"
        if any("--metrics-address" in a for a in c.get("args", [])):
            metrics.append(where + " --metrics-address")
        if any(e.get("name") == "RBD_NBD_GO_METRICS_ADDRESS" for e in c.get("env", [])):
            metrics.append(where + " RBD_NBD_GO_METRICS_ADDRESS")
        if any("metrics" in p.get("name", "") for p in c.get("ports", [])):
            metrics.append(where + " metrics port")
check(not metrics, "no --metrics-address, RBD_NBD_GO_METRICS_ADDRESS or metrics port" +
      (f" (found {', '.join(metrics)})" if metrics else ""))

cm = by("ConfigMap", "ceph-csi-config")
check(len(cm) == 1, "the ConfigMap ceph-csi-config")
if cm:
    try:
        cfg = json.loads(cm[0]["data"]["config.json"])
    except (KeyError, ValueError) as e:
        cfg = f"unreadable: {e}"
    check(cfg == [{"clusterID": "check-cluster", "monitors": ["198.51.100.1:6789", "198.51.100.2:3300"],
                   "rbd": {"radosNamespace": "check-ns"}}],
          "... its config.json holds the one cluster of csiConfig" + ("" if isinstance(cfg, list) else f" ({cfg})"))

for kind, name in (("Deployment", "rbd-nbd-go-controller"), ("DaemonSet", "rbd-nbd-go-node")):
    check(len(by(kind, name)) == 1, f"the {kind} {name} still")
sys.exit(bool(bad))
PY
	pass "helm template with check values (StorageClass, Secret, csiConfig, no snapshot-controller, no metrics)"
else
	fail "helm template with check values"
fi

# 4. the examples
if python3 "$tmp/compare.py" "$tmp/examples.json" "$tmp/classes.json" "examples/"; then
	pass "helm template (storageClass, volumeSnapshotClass, secret .create=true) = examples/{$(IFS=,; echo "${examples[*]}")}"
else
	fail "helm template (storageClass, volumeSnapshotClass, secret .create=true) != examples/{$(IFS=,; echo "${examples[*]}")}"
fi

if [ $failed -ne 0 ]; then
	echo "check: FAILED"
	exit 1
fi
echo "check: passed"
