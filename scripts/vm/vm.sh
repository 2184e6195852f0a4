#!/bin/bash
# Boot Debian's kernel (which has nbd.ko) under qemu and run one command
# inside, with the host's root shared read-only over 9p under a tmpfs
# overlay, so the project's binaries and Debian's tools run unchanged.
#
#   scripts/vm/vm.sh [--mem 4G] [--smp 2] [--timeout SECONDS] [--share DIR] -- COMMAND [ARGS...]
#
# --share DIR makes host directory DIR writable at the same path in the VM
# (for results); everything else the VM writes vanishes with it.
# COMMAND runs in the VM as root, in the current directory, with lo up
# and no other network. Its output goes to the serial console (our
# stdout); our exit status is its exit status (124 on timeout, 125 if
# the VM never reported one). A guest kernel that hangs is run again
# once (VM_HANG_RETRIES=0 turns that off). The kernel package is fetched once with
# apt-get download into $VM_CACHE (default /var/cache/rbd-nbd-go-vm).
set -euo pipefail

mem=4G
smp=2
timeout=1200
share=
while [ $# -gt 0 ]; do
	case $1 in
	--mem) mem=$2; shift 2 ;;
	--smp) smp=$2; shift 2 ;;
	--timeout) timeout=$2; shift 2 ;;
	--share) share=$(mkdir -p "$2" && cd "$2" && pwd); shift 2 ;;
	--) shift; break ;;
	*) echo "vm.sh: unknown option $1" >&2; exit 2 ;;
	esac
done
[ $# -gt 0 ] || { echo "vm.sh: no command" >&2; exit 2; }

cache=${VM_CACHE:-/var/cache/rbd-nbd-go-vm}
pkg=${VM_KERNEL_PKG:-}
mkdir -p "$cache"

for tool in qemu-system-x86_64 busybox; do
	command -v $tool >/dev/null || { echo "vm.sh: $tool missing (make deps installs it)" >&2; exit 2; }
done

# The newest Debian kernel image the archive offers.
if [ -z "$pkg" ]; then
	pkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
	[ -n "$pkg" ] || { echo "vm.sh: cannot find Debian's kernel package (apt-get update?)" >&2; exit 2; }
fi
kdir=$cache/$pkg
if [ ! -f "$kdir/.done" ]; then
	rm -rf "$kdir"; mkdir -p "$kdir"
	(cd "$cache" && ls ${pkg}_*.deb >/dev/null 2>&1 || apt-get download "$pkg" >/dev/null 2>&1) ||
		{ echo "vm.sh: apt-get download $pkg failed" >&2; exit 2; }
	dpkg-deb -x "$(ls "$cache"/${pkg}_*.deb | head -1)" "$kdir"
	touch "$kdir/.done"
fi
kver=$(ls "$kdir/lib/modules" | head -1)
vmlinuz=$kdir/boot/vmlinuz-$kver
moddir=$kdir/lib/modules/$kver/kernel

work=$(mktemp -d /tmp/rbd-nbd-go-vm.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/initrd/bin" "$work/initrd/mods" "$work/initrd/proc" "$work/initrd/sys" "$work/initrd/dev" "$work/out"

# Modules for 9p, overlay, loop, ext4 and xfs, in dependency order, veth
# (e2e-k8s's pods off the host network), and
# dm-crypt with aes-xts (ceph-csi's encryption: cryptsetup on a mapped
# device, for the migration test and the bench; aesni fails to load on a
# CPU without AES-NI, and the generic AES serves). nbd is deliberately not
# loaded: rbd-nbd-go loads it itself (pmorjan/kmod).
mods="virtio/virtio_ring virtio/virtio_pci_modern_dev virtio/virtio_pci_legacy_dev virtio/virtio
virtio/virtio_pci char/hw_random/virtio-rng net/9p/9pnet net/9p/9pnet_virtio fs/netfs/netfs fs/fscache/fscache fs/9p/9p
fs/overlayfs/overlay drivers/block/loop arch/x86/crypto/crc32c-intel crypto/crc32c_generic
lib/libcrc32c fs/jbd2/jbd2 fs/mbcache lib/crc16 fs/ext4/ext4 fs/xfs/xfs
md/dm-mod md/dm-crypt crypto/xts crypto/cryptd crypto/crypto_simd arch/x86/crypto/aesni-intel net/veth"
: > "$work/initrd/modules"
for m in $mods; do
	f=$(ls "$moddir"/*/$m.ko "$moddir"/$m.ko 2>/dev/null | head -1 || true)
	[ -z "$f" ] && f=$(find "$moddir" -path "*/$m.ko" | head -1)
	[ -n "$f" ] || { echo "vm.sh: module $m not in $pkg" >&2; exit 2; }
	cp "$f" "$work/initrd/mods/"
	basename "$f" >> "$work/initrd/modules"
done
cp /bin/busybox "$work/initrd/bin/busybox"
printf '%s\n' "$kver" > "$work/initrd/kver"
printf '%s' "$share" > "$work/initrd/sharepath"
printf '%s\n' "$kdir/lib/modules/$kver" > "$work/initrd/kmods"

cat > "$work/initrd/init" <<'INIT'
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /modules); do insmod /mods/$m 2>/dev/null; done
mkdir -p /host /rw /newroot
o="trans=virtio,version=9p2000.L,msize=512000"
mount -t 9p -o $o,cache=loose,ro hostroot /host || { echo "VM: 9p mount failed"; poweroff -f; }
mount -t tmpfs -o size=80% tmpfs /rw
mkdir -p /rw/upper /rw/work
mount -t overlay overlay -o lowerdir=/host,upperdir=/rw/upper,workdir=/rw/work /newroot
for d in proc sys dev tmp run vm-out; do mkdir -p /newroot/$d; done
mount -t proc proc /newroot/proc
mount -t sysfs sys /newroot/sys
mount -t devtmpfs dev /newroot/dev
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts devpts /newroot/dev/pts
mount -t tmpfs tmpfs /newroot/dev/shm
# /tmp stays the overlay's: a checkout under the host's /tmp must be visible.
mount -t tmpfs tmpfs /newroot/run
mount -t 9p -o $o out /newroot/vm-out
if [ -s /sharepath ]; then mkdir -p "/newroot$(cat /sharepath)"; mount -t 9p -o $o vmshare "/newroot$(cat /sharepath)"; fi
ln -sf /proc/self/fd /newroot/dev/fd
ln -sf /proc/self/fd/0 /newroot/dev/stdin
ln -sf /proc/self/fd/1 /newroot/dev/stdout
ln -sf /proc/self/fd/2 /newroot/dev/stderr
# A modules tree for the running kernel holding nbd only, so that loading
# it on demand is tested for real.
kver=$(cat /kver)
km=/newroot/lib/modules/$kver
mkdir -p $km/kernel/drivers/block
cp /newroot$(cat /kmods)/kernel/drivers/block/nbd.ko $km/kernel/drivers/block/
cp /newroot$(cat /kmods)/modules.builtin $km/ 2>/dev/null || : > $km/modules.builtin
echo "kernel/drivers/block/nbd.ko:" > $km/modules.dep
# Netfilter for iptables-legacy, copied but not loaded: the chaos soak
# (e2e/csi.sh soak) loads it to cut the OSD off.
for m in netfilter/x_tables ipv4/netfilter/ip_tables ipv4/netfilter/iptable_filter netfilter/xt_tcpudp; do
	mkdir -p $km/kernel/net/$(dirname $m)
	cp /newroot$(cat /kmods)/kernel/net/$m.ko $km/kernel/net/$m.ko 2>/dev/null
done
: > $km/modules.alias
# Moved onto / (as switch_root does), not only chrooted into: a process
# that joins a mount namespace (runc exec, nsenter) lands on the mounts
# stacked over the namespace's root, which a bare chroot would leave as
# the initramfs (kubectl exec then finds no working directory). "." is
# the overlay still: the working directory survives the move.
cd /newroot && mount --move /newroot /
chroot . /bin/sh -c 'ip link set lo up; hostname rbd-nbd-go-vm; . /vm-out/env; cd "$VM_CWD"; timeout -k 10 "$VM_TIMEOUT" /bin/sh /vm-out/cmd </dev/null >/dev/ttyS0 2>&1; echo $? > /vm-out/rc'
poweroff -f
INIT
chmod +x "$work/initrd/init"
(cd "$work/initrd" && find . | busybox cpio -o -H newc 2>/dev/null | gzip -1) > "$work/initrd.gz"

# The command, quoted, and its environment.
{
	printf 'exec'
	for a in "$@"; do printf ' %q' "$a"; done
	printf '\n'
} > "$work/out/cmd"
{
	printf 'export PATH=%q\n' "/usr/local/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	printf 'export HOME=/root VM_CWD=%q VM_TIMEOUT=%q\n' "$PWD" "$((timeout - 30))"
	for v in $(compgen -e | grep -E '^(RBD_NBD_GO_|E2E_|BENCH_)' || true); do printf 'export %s=%q\n' "$v" "${!v}"; done
} > "$work/out/env"

qemu_accel="-accel tcg,thread=multi,tb-size=512 -cpu max"
# A guest whose scheduler stops must fail in minutes, not at CI's limit:
# once in CI both vCPUs sat in a soft lockup for 45 min after the RCU
# kthread's timer never fired (TCG; never seen here). So a soft lockup
# or an RCU stall of 60 s panics the guest (healthy runs never show
# either at 20 s), qemu exits, and the command runs again once in a
# fresh VM (VM_HANG_RETRIES), with the panic's stack on the console.
append="console=ttyS0 panic=-1 loglevel=3 mitigations=off edd=off rdinit=/init quiet"
append+=" softlockup_panic=1 watchdog_thresh=30 rcupdate.rcu_cpu_stall_timeout=60 sysctl.kernel.panic_on_rcu_stall=1"
retries=${VM_HANG_RETRIES:-1}
for ((attempt = 0; ; attempt++)); do
	rm -f "$work/out/rc"
	set +e
	timeout -k 10 "$timeout" qemu-system-x86_64 $qemu_accel -smp "$smp" -m "$mem" -M q35 \
		-nodefaults -no-user-config -display none -monitor none -serial stdio -no-reboot -nic none \
		-object rng-random,id=rng0,filename=/dev/urandom -device virtio-rng-pci,rng=rng0 \
		-kernel "$vmlinuz" -initrd "$work/initrd.gz" -append "$append" \
		-virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
		-virtfs local,path="$work/out",mount_tag=out,security_model=none \
		${share:+-virtfs local,path=$share,mount_tag=vmshare,security_model=none} </dev/null | tee "$work/console"
	qrc=${PIPESTATUS[0]}
	set -e
	if [ -s "$work/out/rc" ]; then
		exit "$(cat "$work/out/rc")"
	fi
	[ $qrc -eq 124 ] && { echo "vm.sh: VM timed out after ${timeout}s" >&2; exit 124; }
	if grep -q "Kernel panic - not syncing: \(softlockup\|RCU Stall\)" "$work/console"; then
		if [ "$attempt" -lt "$retries" ]; then
			echo "vm.sh: the guest kernel hung (its panic is above); running the command again in a fresh VM" >&2
			continue
		fi
		echo "vm.sh: the guest kernel hung (its panic is above), $((attempt + 1)) times" >&2
		exit 125
	fi
	echo "vm.sh: the VM ended without a result (qemu exit $qrc)" >&2
	exit 125
done
