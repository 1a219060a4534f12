#!/bin/busybox sh
# AgentBox initramfs /init: load the virtio drivers, mount the ext4 root from
# /dev/vda and hand PID 1 over to /sbin/agentbox-init.
#
# Kernel command line (all optional):
#   root=/dev/vda          block device holding the root file system
#   rootfstype=ext4        its type
#   rootflags=OPTS         extra mount options
#   ro | rw                mount read-only / read-write (default rw)
#   agentbox.init=PATH     program to run as PID 1 on the new root
#   agentbox.debug         on failure drop to a shell instead of powering off
#
# Any failure is printed to the console and, unless agentbox.debug is set, the
# VM powers off so the VMM exits instead of hanging with nobody watching.

/bin/busybox mkdir -p /proc /sys /dev /newroot /usr/bin /usr/sbin /sbin
/bin/busybox --install -s
export PATH=/sbin:/bin:/usr/sbin:/usr/bin

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null

root=/dev/vda
fstype=ext4
flags=
mode=rw
init=/sbin/agentbox-init
debug=
for arg in $(cat /proc/cmdline); do
    case "$arg" in
        root=*) root="${arg#root=}" ;;
        rootfstype=*) fstype="${arg#rootfstype=}" ;;
        rootflags=*) flags="${arg#rootflags=}" ;;
        ro) mode=ro ;;
        rw) mode=rw ;;
        agentbox.init=*) init="${arg#agentbox.init=}" ;;
        agentbox.debug|agentbox.debug=1) debug=1 ;;
    esac
done

fail() {
    echo "agentbox-initramfs: ERROR: $*" > /dev/console
    if [ -n "$debug" ]; then
        echo "agentbox-initramfs: agentbox.debug set, starting a shell" > /dev/console
        exec setsid cttyhack sh
    fi
    echo "agentbox-initramfs: powering off (add agentbox.debug for a shell)" > /dev/console
    sync
    poweroff -f
    reboot -f
}

# Dependencies first; the order was computed at build time from .modinfo.
for ko in $(cat /lib/modules/load-order); do
    insmod "/lib/modules/$ko" || fail "insmod $ko failed"
done

# virtio-mmio probes asynchronously: give the disk a moment to appear.
tries=0
while [ ! -b "$root" ]; do
    tries=$((tries + 1))
    [ "$tries" -gt 200 ] && fail "root device $root did not appear (is a virtio-blk disk attached?)"
    sleep 0.05
done

opts="$mode"
[ -n "$flags" ] && opts="$opts,$flags"
mount -t "$fstype" -o "$opts" "$root" /newroot || fail "cannot mount $root ($fstype, $opts)"
[ -x "/newroot$init" ] || fail "$init is missing or not executable on $root"

# The new init mounts its own /proc and /sys; /dev (devtmpfs) moves along so
# the console and the disk stay valid across switch_root.
umount /proc /sys
mkdir -p /newroot/dev
mount --move /dev /newroot/dev || umount /dev
exec switch_root /newroot "$init"
