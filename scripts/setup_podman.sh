#!/usr/bin/env bash
# Sets up a container engine on a Debian machine without Docker: podman with runc, and a local base
# image built from Debian's own packages (for machines that cannot pull from Docker Hub or NGC).
#
#   scripts/setup_podman.sh [BASE_TAG]      (default: localhost/ctrflow-base:bookworm)
#
# Idempotent: each part is skipped when it is already there. Needs root (apt, debootstrap).
# The base holds Debian's Python 3.11 with pip and its shared libpython (Triton's python backend links it).
set -euo pipefail

BASE_TAG="${1:-localhost/ctrflow-base:bookworm}"
CONF=/etc/containers/containers.conf
start=$(date +%s)

missing=()
for tool in podman runc debootstrap; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if (( ${#missing[@]} )); then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends podman runc debootstrap \
    uidmap slirp4netns netavark aardvark-dns iptables
fi

# runc, not crun: crun's setrlimit fails where the sandbox lacks CAP_SYS_RESOURCE, and so do the
# default ulimits. Host networking by default; a job's own network is asked for by name.
if [[ ! -f "$CONF" ]]; then
  mkdir -p "$(dirname "$CONF")"
  cat > "$CONF" <<'CONF'
[containers]
default_ulimits = []
netns = "host"

[engine]
runtime = "runc"

[network]
network_backend = "netavark"
CONF
fi

if ! podman image exists "$BASE_TAG"; then
  rootfs="$(mktemp -d)"
  trap 'rm -rf "$rootfs"' EXIT
  debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,libpython3.11,ca-certificates \
    bookworm "$rootfs" http://deb.debian.org/debian >/dev/null
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - "$BASE_TAG" >/dev/null
fi
echo "podman $(podman --version | awk '{print $3}') ready, base image $BASE_TAG ($(( $(date +%s) - start )) s)"
