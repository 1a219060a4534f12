#!/usr/bin/env bash
# Install the Debian packages AgentBox needs on this host (idempotent; apt only when missing).
set -euo pipefail
PACKAGES=(
  qemu-system-x86 qemu-utils       # the VMM (microvm machine) and qcow2 layers
  debootstrap e2fsprogs            # template root filesystems (mkfs.ext4 -d, no loop mounts)
  busybox-static cpio zstd         # the guest initramfs
  iproute2 nftables                # per-sandbox namespaces, veth, TAP, egress rules
  python3 python3-venv             # the daemon's virtualenv
  ca-certificates
  chromium wrk nginx-light         # browser e2e test (headless); bench/proxy.py (wrk, nginx)
  etcd-server                      # [cluster]: placement, ownership, host leases (etcd v3)
)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "host packages: all present"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "missing packages: ${missing[*]} (run as root to install them)" >&2
  exit 1
fi
echo "host packages: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends "${missing[@]}"
