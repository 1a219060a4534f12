#!/usr/bin/env bash
# Build the AgentBox guest kernel (uncompressed ELF vmlinux) for Firecracker.
#
#   images/firecracker/build_kernel.sh [OUT_DIR]
#
# Source: Debian's linux-source-6.1 (apt, from the host's configured mirror).
# Config: arch/x86/configs/x86_64_defconfig + microvm-x86_64.config (a fragment),
# checked after `make olddefconfig`. Output:
#   OUT_DIR/vmlinux-<hash>   (hash of source version + fragment + RECIPE)
#   OUT_DIR/vmlinux          (stable symlink to the newest build)
# A build whose hash already exists is skipped, so re-running is cheap.
#
# Environment: OUT_DIR (default /var/lib/agentbox/images/firecracker),
# BUILD_DIR (default /var/tmp/agentbox-kernel), JOBS (default nproc),
# KEEP_BUILD=1 keeps the unpacked tree. Run it under `nice -n 19` on shared hosts.
# Measured: 879 s wall (nice -n 19, -j2, a busy shared 2-core VM); 51 MB vmlinux.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
FRAGMENT="$HERE/microvm-x86_64.config"
OUT_DIR="${1:-${OUT_DIR:-/var/lib/agentbox/images/firecracker}}"
BUILD_DIR="${BUILD_DIR:-/var/tmp/agentbox-kernel}"
JOBS="${JOBS:-$(nproc)}"
SRC_PKG=linux-source-6.1
BUILD_DEPS=(build-essential bc bison flex libelf-dev libssl-dev xz-utils cpio kmod)

say() { printf '[kernel] %s\n' "$*" >&2; }

install_deps() {
    local missing=()
    for pkg in "$SRC_PKG" "${BUILD_DEPS[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' \
            || missing+=("$pkg")
    done
    [ "${#missing[@]}" -eq 0 ] && return 0
    say "installing: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y --no-install-recommends "${missing[@]}" \
        || { apt-get update && apt-get install -y --no-install-recommends "${missing[@]}"; }
}

# What changes the output goes into the cache key: the source package version,
# the fragment, and RECIPE, bumped by hand whenever a step below changes the result
# (editing comments or messages must not throw away a 15-minute build).
RECIPE=1
build_hash() {
    local src_version
    src_version="$(dpkg-query -W -f='${Version}' "$SRC_PKG")"
    { echo "$SRC_PKG $src_version recipe=$RECIPE"; cat "$FRAGMENT"; } | sha256sum | cut -c1-16
}

unpack() {
    local tree="$1"
    rm -rf "$tree" && mkdir -p "$tree"
    say "unpacking /usr/src/$SRC_PKG.tar.xz"
    tar -C "$tree" --strip-components=1 -xf "/usr/src/$SRC_PKG.tar.xz"
}

configure() {
    local tree="$1"
    say "configuring: x86_64_defconfig + $(basename "$FRAGMENT")"
    make -C "$tree" -s x86_64_defconfig
    (cd "$tree" && KCONFIG_CONFIG=.config scripts/kconfig/merge_config.sh -m .config "$FRAGMENT" >/dev/null)
    make -C "$tree" -s olddefconfig
    check_config "$tree/.config"
}

# Fail if olddefconfig dropped or changed anything the fragment asked for.
check_config() {
    local config="$1" bad=0 line name
    while IFS= read -r line; do
        case "$line" in
            CONFIG_*=*)
                grep -qxF -- "$line" "$config" || { say "config: wanted $line, got: $(grep -E "^(# )?${line%%=*}[= ]" "$config" || echo absent)"; bad=1; } ;;
            "# CONFIG_"*" is not set")
                name="${line#\# }"; name="${name%% *}"
                if grep -qE "^$name=[ym]" "$config"; then say "config: wanted $name off, still on"; bad=1; fi ;;
        esac
    done < "$FRAGMENT"
    [ "$bad" -eq 0 ] || { say "config check failed"; exit 1; }
}

main() {
    install_deps
    local hash target tree start
    hash="$(build_hash)"
    target="$OUT_DIR/vmlinux-$hash"
    mkdir -p "$OUT_DIR"
    if [ -s "$target" ]; then
        say "cached: $target"
    else
        tree="$BUILD_DIR/linux-$hash"
        start=$(date +%s)
        # Expanded now: the trap runs after main's locals are gone.
        [ "${KEEP_BUILD:-0}" = 1 ] || trap "rm -rf '$tree' '$target.tmp'" EXIT
        unpack "$tree"
        configure "$tree"
        say "building vmlinux with -j$JOBS"
        make -C "$tree" -s -j"$JOBS" vmlinux
        cp "$tree/vmlinux" "$target.tmp"
        cp "$tree/.config" "$target.config"
        mv -f "$target.tmp" "$target"
        say "built in $(( $(date +%s) - start ))s: $target"
    fi
    ln -sfn "vmlinux-$hash" "$OUT_DIR/vmlinux.tmp"
    mv -Tf "$OUT_DIR/vmlinux.tmp" "$OUT_DIR/vmlinux"
    echo "$target"
}

main "$@"
