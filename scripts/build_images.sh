#!/usr/bin/env bash
# Builds the training and serving images (docker/Dockerfile.train, docker/Dockerfile.serve) with
# docker or podman, whichever runs here.
#
#   scripts/build_images.sh [train|serve|all]      (default: all)
#
# Settings (environment):
#   IMAGE_REPO   name prefix (default localhost/ctrflow: ctrflow-train and ctrflow-serve under it)
#   IMAGE_TAG    tag (default 0.1.0)
#   TRAIN_BASE   the training image's BASE (default: the Dockerfile's CUDA PyTorch image)
#   SERVE_BASE   the serving image's BASE (default: the Dockerfile's Triton image)
#   SERVE_ARGS   more build arguments of the serving image, e.g. "WITH_TORCH=1 TRITON_WHEEL=nvidia-pytriton==0.7.0"
#   HOST_PIP=1   (podman) the build's pip uses this machine's pip settings (its find-links folders,
#                mounted read-only, and CA bundle) and network: for machines whose registry is a mirror
# Prints each image's build time and size.
set -euo pipefail
cd "$(dirname "$0")/.."

which_images="${1:-all}"
REPO="${IMAGE_REPO:-localhost/ctrflow}"
TAG="${IMAGE_TAG:-0.1.0}"

if docker info >/dev/null 2>&1; then
  engine=docker
elif command -v podman >/dev/null; then
  engine=podman
else
  echo "build_images: error: no container engine: neither a running docker nor podman (make podman sets podman up)" >&2
  exit 2
fi

flags=()
if [[ "${HOST_PIP:-0}" == 1 ]]; then
  if [[ "$engine" != podman ]]; then  # docker build mounts no folders
    echo "build_images: error: HOST_PIP=1 needs podman" >&2
    exit 2
  fi
  flags+=(--network host)
  links="$(python3 -m pip config get global.find-links 2>/dev/null || echo "${PIP_FIND_LINKS:-}")"
  for dir in $links; do
    if [[ -d "$dir" ]]; then flags+=(-v "$dir:$dir:ro"); fi
  done
  if [[ -n "$links" ]]; then flags+=(--build-arg "PIP_FIND_LINKS=$links"); fi
  if [[ -d /etc/ssl/certs ]]; then flags+=(-v /etc/ssl/certs:/etc/ssl/certs:ro); fi
fi

build() {  # build NAME DOCKERFILE [BUILD_ARG...]
  local name="$1" file="$2" start
  shift 2
  local args=()
  for arg in "$@"; do args+=(--build-arg "$arg"); done
  start=$(date +%s)
  "$engine" build "${flags[@]}" "${args[@]}" -f "$file" -t "$REPO/$name:$TAG" .
  echo "built $REPO/$name:$TAG with $engine in $(( $(date +%s) - start )) s," \
       "$("$engine" image inspect --format '{{.Size}}' "$REPO/$name:$TAG" | awk '{printf "%.0f MB", $1 / 1e6}')"
}

if [[ "$which_images" == all || "$which_images" == train ]]; then
  build ctrflow-train docker/Dockerfile.train ${TRAIN_BASE:+"BASE=$TRAIN_BASE"}
fi
if [[ "$which_images" == all || "$which_images" == serve ]]; then
  # shellcheck disable=SC2086  # SERVE_ARGS: NAME=VALUE words
  build ctrflow-serve docker/Dockerfile.serve ${SERVE_BASE:+"BASE=$SERVE_BASE"} ${SERVE_ARGS:-}
fi
