#!/usr/bin/env bash
# README's test command: installs what is missing, builds (warnings as errors), runs every
# test (ctest).
# Options through the environment, as for deploy/build.sh; FERRY_TEST_LABELS picks ctest
# labels (default: all), FERRY_TEST_EXCLUDE a regular expression of tests to leave out.
set -euo pipefail
cd "$(dirname "$0")/.."
FERRY_WERROR=${FERRY_WERROR:-ON} bash deploy/build.sh
dir=${FERRY_BUILD_DIR:-build}
args=(--test-dir "$dir" --output-on-failure -j 2)
[ -n "${FERRY_TEST_LABELS:-}" ] && args+=(-L "$FERRY_TEST_LABELS")
[ -n "${FERRY_TEST_EXCLUDE:-}" ] && args+=(-E "$FERRY_TEST_EXCLUDE")
ctest "${args[@]}"
