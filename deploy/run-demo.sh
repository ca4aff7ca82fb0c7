#!/usr/bin/env bash
# README's main-job command: installs what is missing, builds, and runs ferry-demo: two ferryd
# on loopback (own data dirs, embedded RocksDB); a non-contiguous 256 MiB object (4096 pieces of
# 64 KiB in shuffled order) is published on A, pulled by B over RDMA WRITEs (libfabric tcp
# provider, 4 rails), read back from B over REST and checked byte for byte; both nodes stop.
# Extra flags go to ferry-demo (--size, --piece, --rails).
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/build.sh
exec "${FERRY_BUILD_DIR:-build}/client/ferry-demo" "$@"
