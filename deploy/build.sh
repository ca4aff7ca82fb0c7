#!/usr/bin/env bash
# Installs the dependencies, then configures and builds ferry with CMake and Ninja.
#   FERRY_BUILD_DIR   build folder (default: build)
#   FERRY_SANITIZE    e.g. address,undefined (default: none)
#   FERRY_LIBFABRIC_PREFIX  another libfabric, e.g. /opt/amazon/efa (default: the system's)
#   FERRY_CUDA        AUTO (use CUDA when /usr/local/cuda has it), ON or OFF (default: AUTO)
#   FERRY_WERROR      ON: warnings are errors (default: OFF; deploy/test.sh turns it on)
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install-deps.sh
dir=${FERRY_BUILD_DIR:-build}
cmake -S . -B "$dir" -G Ninja \
  -DFERRY_SANITIZE="${FERRY_SANITIZE:-}" \
  -DFERRY_LIBFABRIC_PREFIX="${FERRY_LIBFABRIC_PREFIX:-}" \
  -DFERRY_CUDA="${FERRY_CUDA:-AUTO}" \
  -DFERRY_WERROR="${FERRY_WERROR:-OFF}" >/dev/null
ninja -C "$dir"
