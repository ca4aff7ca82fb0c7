#!/usr/bin/env bash
# CI stage: builds ferry against a libfabric 2.x with CUDA (the kind the EFA installer brings)
# and runs the CPU tests with it. FERRY_LF2 names the prefix (default: ../shared/libfabric-2.6-cuda
# beside the checkout); without one the stage says so and passes.
set -euo pipefail
cd "$(dirname "$0")/.."
src=${FERRY_LF2:-../shared/libfabric-2.6-cuda}
if [ ! -f "$src/lib/pkgconfig/libfabric.pc" ]; then
  echo "lf2-stage: no libfabric 2.x prefix at $src: skipped"
  exit 0
fi
build=${FERRY_BUILD_DIR:-build-lf2}
# A copy inside the build folder, at a path that stays (the build records it).
prefix=$PWD/$build/libfabric-prefix
rm -rf "$prefix"
mkdir -p "$prefix"
cp -r "$src/." "$prefix/"
chmod -R u+w "$prefix"
# A prefix copied without its symbolic links has, for each, a small file naming the target.
for f in "$prefix"/lib/*.so*; do
  if [ -f "$f" ] && [ "$(stat -c %s "$f")" -lt 256 ] && ! head -c 4 "$f" | grep -q ELF; then
    target=$(cat "$f")
    rm "$f"
    ln -s "$target" "$f"
  fi
done
echo "lf2-stage: libfabric $(PKG_CONFIG_PATH=$prefix/lib/pkgconfig pkg-config --modversion libfabric) from $src"
FERRY_BUILD_DIR=$build FERRY_CUDA=OFF FERRY_LIBFABRIC_PREFIX="$prefix" \
  FERRY_TEST_LABELS='unit|integration' bash deploy/test.sh
