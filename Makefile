# rbd-nbd-go. `make run` and `make test` work on a fresh Debian 12 machine as
# root: both install what they need first (scripts/deps.sh).
export PATH := /usr/local/go/bin:$(PATH)
# go-ceph v0.41 selects the pacific (Ceph 16, Debian 12) API with this tag.
export GOFLAGS := -tags=pacific $(GOFLAGS)
GO      ?= go
BIN     := bin/rbd-nbd-go
GOFILES := $(shell find . -name '*.go' -not -path './bin/*')

.PHONY: all deps build test unit interop lint fuzz bench bench-vm bench-vm-scale bench-vm-csi bench-vm-restart e2e e2e-csi e2e-k8s e2e-k8s-conformance soak run clean

all: build

deps:
	@scripts/deps.sh

build: $(BIN)

$(BIN): $(GOFILES) go.mod go.sum
	$(GO) build -o $@ ./cmd/rbd-nbd-go

lint:
	@out=$$(gofmt -l $(GOFILES)); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...

# Unit, fuzz-seed, interop and Ceph tests, with the race detector. Test
# packages needing Ceph start their own dev cluster. Interop clients and
# Ceph are required here: a missing one fails rather than skips. The
# packages take about a minute together; the timeout only caps a hang.
test: deps lint build
	RBD_NBD_GO_INTEROP=required RBD_NBD_GO_CEPH=required $(GO) test -race -count=1 -timeout 12m ./...
	$(MAKE) --no-print-directory e2e

# The kernel path for real: the scenarios in e2e/scenarios.sh inside a qemu
# VM booting Debian's kernel (this machine's kernel has no NBD). Scenario c
# gets its own 4-vCPU VM: blk-mq makes at most one hardware queue per CPU,
# and 4 emulated CPUs on this 2-core box slow everything else down.
e2e: deps build
	scripts/vm/vm.sh --timeout 2400 -- e2e/scenarios.sh a b d e f g h i j k l
	scripts/vm/vm.sh --smp 4 --timeout 900 -- e2e/scenarios.sh c
	$(MAKE) --no-print-directory e2e-csi
	$(MAKE) --no-print-directory e2e-k8s K8S_SCENARIOS="$(K8S_TEST_SCENARIOS)"

# The e2e-k8s scenarios make test runs: f (restarts under I/O and the
# stalls they cost), g (bad input) and a fixed three-spec subset of
# Kubernetes' own storage tests (a restore, with data kept across pods;
# a block clone; a VolumeAttributesClass swapped). The rest run in the full `make e2e-k8s`
# and `make e2e-k8s-conformance`: this box's speed varies about four-fold,
# and make test must stay inside CI's 90 minutes on a slow day. Their
# driver paths run in e2e-csi on real /dev/nbd (TestRetainAndStaticVolume,
# TestOnlineExpand, TestSnapshotRestoreCloneMounted, TestEncryptedVolume,
# TestQoSLiveModify; raw block in csi-sanity's block access), and the
# subset covers provisioning, raw block, a restore and a clone through
# Kubernetes.
K8S_TEST_SCENARIOS = f g conformance

# The CSI driver on real /dev/nbd in the VM: upstream csi-sanity (its node
# and identity specs; the host's go test ran the controller half), a
# volume's life, Retain/static, online expand, restart
# survival, bad input, snapshots, restores and clones of mounted volumes
# (csi/conformance), ceph-csi's call sequence with this binary installed
# as rbd-nbd, and the chaos soak for 5 minutes (e2e/csi.sh).
e2e-csi: deps build bin/csi-conformance.test
	mkdir -p bin/e2e-csi
	E2E_OUT=$(CURDIR)/bin/e2e-csi scripts/vm/vm.sh --mem 6G --timeout 4200 --share $(CURDIR)/bin/e2e-csi -- e2e/csi.sh

# The chaos soak alone, for SOAK_MIN minutes (30 unless set): eight CSI
# volumes under fio verify and an fsync'd append log while the plugin,
# its daemon and the OSD are killed, upgraded and cut off, one fault every
# 20-60 s (20-30 s under 10 minutes, as make test's 5) from a printed
# seed (RBD_NBD_GO_SOAK_SEED repeats it; RBD_NBD_GO_SOAK_FAULTS=upgrade,...
# deals only those kinds, docs/testing.md). Its
# fault table is kept in bench/reference/soak, dated.
SOAK_MIN ?= 30
soak: deps build bin/csi-conformance.test
	mkdir -p bin/soak bench/reference/soak
	E2E_OUT=$(CURDIR)/bin/soak E2E_SOAK_MIN=$(SOAK_MIN) scripts/vm/vm.sh --mem 6G --timeout $$(( ($(SOAK_MIN) * 2 + 20) * 60 )) \
		--share $(CURDIR)/bin/soak -- e2e/csi.sh soak
	cp bin/soak/soak.md bench/reference/soak/$$(date -u +%F)-$(SOAK_MIN)min.md

# The driver in a real single-node Kubernetes (v1.36.1, built from the
# module proxy by e2e/k8s/build-tools.sh and cached outside the checkout)
# inside the VM, deployed from deploy/kubernetes: provisioning, Retain,
# raw block, online expansion, snapshots, restores and clones, node-plugin
# restart under I/O, bad input, an encrypted PVC's life, and a QoS class
# changed under fio (e2e/k8s.sh names each scenario and prints its time).
# K8S_SCENARIOS picks some (letters); empty runs all. The Helm chart's
# static check (lint, and the same objects as deploy/kubernetes) runs
# here on the host, in seconds, where TCG took most of a minute; the VM
# applies what the chart renders.
HELM_CHECK = e2e/k8s/helm/check.sh deploy/helm/rbd-nbd-go deploy/kubernetes >bin/helm-check.out 2>&1 || \
	{ grep -E '^FAIL|differ|rror' bin/helm-check.out | head -5; echo "the Helm chart check failed: bin/helm-check.out"; exit 1; }
e2e-k8s: deps build
	e2e/k8s/images.sh bin/k8s-images
	$(HELM_CHECK)
	mkdir -p bin/e2e-k8s
	E2E_OUT=$(CURDIR)/bin/e2e-k8s scripts/vm/vm.sh --mem 6G --timeout 4200 --share $(CURDIR)/bin/e2e-k8s -- e2e/k8s.sh $(CURDIR)/bin/k8s-images $(K8S_SCENARIOS)

# Kubernetes' own storage tests for CSI drivers: every External.Storage
# spec of k8s.io/kubernetes v1.36.1's e2e suite (storage-e2e.test, built
# by e2e/k8s/build-tools.sh) against the driver deployed in the VM's
# single-node cluster, but the skips docs/conformance.md lists. make test
# runs a fixed subset (scenario conformance). The counts by test pattern,
# the failures and the skip reasons go to bench/reference/conformance,
# dated, pass or fail (with E2E_CONFORMANCE_FOCUS set, beside its run:
# bin/e2e-k8s/conformance/focus/report.md).
e2e-k8s-conformance: deps build
	E2E_POPULATOR=1 e2e/k8s/images.sh bin/k8s-images
	$(HELM_CHECK)
	rm -rf bin/e2e-k8s/conformance/all
	mkdir -p bin/e2e-k8s bench/reference/conformance
	E2E_OUT=$(CURDIR)/bin/e2e-k8s scripts/vm/vm.sh --mem 6G --timeout 16200 --share $(CURDIR)/bin/e2e-k8s -- \
		e2e/k8s.sh $(CURDIR)/bin/k8s-images conformance-all; rc=$$?; \
	d=bin/e2e-k8s/conformance/all f=bench/reference/conformance/$$(date -u +%F)-all.md; \
	if [ -n "$$E2E_CONFORMANCE_FOCUS" ]; then d=bin/e2e-k8s/conformance/focus f=$$d/report.md; fi; \
	if python3 e2e/k8s/conformance/report.py $$d/report.json \
		"Kubernetes v1.36.1 storage tests (External.Storage), $$(git rev-parse --short HEAD)" >$$f.tmp; then \
		mv $$f.tmp $$f && echo "result: $$f"; \
	else rm -f $$f.tmp; echo "no report: the run did not get to the suite"; rc=1; fi; \
	exit $$rc

bin/csi-conformance.test: $(GOFILES) go.mod go.sum
	$(GO) test -c -o $@ ./csi/conformance

# A short run of each fuzz target beyond its seed corpus.
fuzz:
	$(GO) test -run '^$$' -fuzz FuzzHandshake -fuzztime 30s ./nbd/
	$(GO) test -run '^$$' -fuzz FuzzTransmission -fuzztime 30s ./nbd/

# Go benchmarks (allocations), then fio: rbd-nbd-go vs nbdkit memory/null
# (bench/results/nbd) and vs direct librbd, go-ceph's sync path and qemu-nbd
# on a dev Ceph cluster (bench/results/rbd). JSON, Markdown table and SVG
# chart each.
bench: deps build
	mkdir -p bench/results
	$(GO) test -run '^$$' -bench . -benchmem ./nbd/ ./rbdio/ | tee bench/results/go-bench.txt
	$(GO) run ./bench/runner -suite nbd -bin $(BIN) -out bench/results/nbd
	$(GO) run ./bench/runner -suite rbd -bin $(BIN) -out bench/results/rbd

# rbd-nbd-go vs Ceph's rbd-nbd on /dev/nbdX inside the VM (ratios only:
# the VM runs under TCG), plain and encrypted (librbd's LUKS2 in our
# daemon vs ceph-csi's dm-crypt over rbd-nbd, 4k jobs). 10G: the three
# filled 1G images live in the memstore OSD, at about twice their size
# (6G: the OSD was OOM-killed filling the third). Results in bench/results/vm.
bench-vm: deps build
	mkdir -p bench/results/vm
	scripts/vm/vm.sh --mem 10G --timeout 3000 --share $(CURDIR)/bench/results/vm -- e2e/bench.sh $(CURDIR)/bench/results/vm
	$(MAKE) --no-print-directory bench-vm-scale
	$(MAKE) --no-print-directory bench-vm-csi
	$(MAKE) --no-print-directory bench-vm-restart

# CSI step times beside ceph-csi's, inside the VM: NodeStage/NodeUnstage
# against the commands ceph-csi's nbd mounter runs (Ceph's rbd-nbd, blkid,
# mkfs, mount), and a mounted volume's snapshot and restore against
# ceph-csi's rbd clone chain (e2e/csi.sh timing; log in
# bench/results/vm-csi/timing.out).
bench-vm-csi: deps build bin/csi-conformance.test
	mkdir -p bench/results/vm-csi
	E2E_OUT=$(CURDIR)/bench/results/vm-csi scripts/vm/vm.sh --mem 6G --timeout 1800 --share $(CURDIR)/bench/results/vm-csi -- e2e/csi.sh timing

# Node scale inside the VM: 8 and 32 images mapped at once, rbd-nbd-go
# with its default connections and with 16 vs one Ceph rbd-nbd per image:
# Pss, Rss, threads, map/unmap times, memory after unmap (table + chart
# in bench/results/vm-scale).
bench-vm-scale: deps build
	mkdir -p bench/results/vm-scale
	scripts/vm/vm.sh --mem 6G --timeout 3000 --share $(CURDIR)/bench/results/vm-scale -- e2e/scale.sh $(CURDIR)/bench/results/vm-scale

# What an upgrade (the daemon handover) and a kill -9 of the node daemon
# cost I/O inside the VM, beside rounds with no event (the floor, in the
# same run) and beside Ceph's rbd-nbd restarted as ceph-csi restarts it:
# eight devices under light steady fio verify, rounds interleaved (table
# in bench/results/restart/restart.md; e2e/restart.sh says how).
bench-vm-restart: deps build
	mkdir -p bench/results/restart
	scripts/vm/vm.sh --mem 4G --timeout 2400 --share $(CURDIR)/bench/results/restart -- e2e/restart.sh $(CURDIR)/bench/results/restart

# Serve a file-backed export on a unix socket and show it working.
run: deps build
	@scripts/run.sh $(BIN)

clean:
	rm -rf bin bench/results
