#!/usr/bin/env bash
# README's main-job command: installs what is missing, builds, and runs the engine demo: two
# processes on loopback, one pulls a non-contiguous 256 MiB buffer from the other over the
# libfabric tcp provider, checks every byte and prints the rate. Extra flags go to ferry-demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/build.sh
exec "${FERRY_BUILD_DIR:-build}/client/ferry-demo" "$@"
