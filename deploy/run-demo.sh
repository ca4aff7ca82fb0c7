#!/usr/bin/env bash
# README's main-job command: installs what is missing, builds, and runs ferry-demo: five ferryd
# on loopback (own data dirs, embedded RocksDB), D keeping the cluster's directory; a
# non-contiguous 256 MiB object (4096 pieces of 64 KiB in shuffled order) is published on A,
# pulled by B from A over RDMA WRITEs (libfabric tcp provider, 4 rails), then distributed by A
# to every other node at once, in a chain; A is killed and E, which deleted its copy, pulls it
# by name from a replica; every copy is read back over REST and checked byte for byte; the
# nodes stop.
# Extra flags go to ferry-demo (--size, --piece, --rails).
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/build.sh
exec "${FERRY_BUILD_DIR:-build}/client/ferry-demo" "$@"
