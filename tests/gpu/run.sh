#!/usr/bin/env bash
# Every GPU check and measurement of ferry in one go, on a GPU machine, from a bundle:
#
#   here:  ninja -C build && ../shared/gpu/bundle.sh .gpu-bundle build/server/ferryd \
#            build/tests/bench/ferry-bench build/tests/gpu/gpu_test
#   there: bash tests/gpu/run.sh [.gpu-bundle] [OUT_DIR]
#
# 1. correctness: gpu_test (GPU0 -> GPU1, GPU -> host, host -> GPU through two ferryd, every
#    byte verified; both nodes on GPU 0 when there is one GPU);
# 2. ferry-bench gpu: 1 GiB pulls (contiguous, 4096 x 256 KiB, 16384 x 64 KiB) on the
#    same-host path and the forced staged path, with cudaMemcpyPeer and the D2H copy rate;
# 3. the raw libfabric tcp rate (ferry-bench engine) and NCCL send/recv (torch), the
#    baselines; then the table (OUT_DIR/table.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
bundle=${1:-.gpu-bundle}
out=${2:-${OUT:-/tmp/ferry-gpu}}
mkdir -p "$out"
# shellcheck disable=SC1091
source "$bundle/env.sh"
export FERRYD="$bundle/bin/ferryd"
nvidia-smi -L | tee "$out/gpus.txt"
date -u +%Y-%m-%dT%H:%MZ >> "$out/gpus.txt"
echo "== correctness"
"$bundle/bin/gpu_test" 2>&1 | tee "$out/gpu_test.log" | grep -E '^\[ +(OK|FAILED|SKIPPED|PASSED) ' || true
if grep -q '^\[  FAILED  \]' "$out/gpu_test.log" || ! grep -q '^\[  PASSED  \]' "$out/gpu_test.log"; then
  echo "gpu_test failed"; tail -50 "$out/gpu_test.log"; exit 1
fi
echo "== benchmark"
: > "$out/rows.jsonl"
timeout 400 "$bundle/bin/ferry-bench" gpu --ferryd "$FERRYD" --json | tee -a "$out/rows.jsonl"
timeout 200 "$bundle/bin/ferry-bench" engine --provider tcp --domain lo --rails 2 \
  --piece 4194304 --total 1073741824 --layout contiguous --iters 3 --json | tee -a "$out/rows.jsonl"
timeout 300 python3 tests/gpu/nccl_bench.py $((1 << 30)) $((256 << 20)) | tee -a "$out/rows.jsonl" || true
python3 tests/gpu/summarize.py "$out/rows.jsonl" | tee "$out/table.md"
