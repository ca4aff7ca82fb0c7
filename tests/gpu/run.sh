#!/usr/bin/env bash
# Every GPU check and measurement of ferry in one go, on a GPU machine, from a bundle:
#
#   here:  ninja -C build && ../shared/gpu/bundle.sh .gpu-bundle build/server/ferryd \
#            build/tests/bench/ferry-bench build/tests/gpu/gpu_test build/client/libferry.so \
#            build/tests/bench/ferry-pull-loop
#   there: bash tests/gpu/run.sh [.gpu-bundle] [OUT_DIR] [HMEM_BUNDLE]
#
# HMEM_BUNDLE: ferryd and gpu_test built against a libfabric with CUDA (FI_HMEM), e.g.
#   cmake -S . -B build-lf2 -G Ninja -DFERRY_LIBFABRIC_PREFIX=<prefix>
#   ../shared/gpu/bundle.sh .gpu-bundle-hmem build-lf2/server/ferryd build-lf2/tests/gpu/gpu_test
# (its lib/ needs only libfabric: the first bundle's libraries are on the path too).
# gpu_test then runs with it too, and the table gains the rdma rows (GPU memory on shm rails).
#
# 1. correctness: gpu_test (GPU0 -> GPU1, GPU -> host, host -> GPU through two ferryd, every
#    byte verified; both nodes on GPU 0 when there is one GPU);
# 2. ferry-bench gpu: 1 GiB pulls (contiguous, 4096 x 256 KiB, 16384 x 64 KiB) on the
#    same-host path and the forced staged path, with cudaMemcpyPeer and the D2H copy rate;
# 2b. with torch there: tests/gpu/torch_test.py (CUDA and CPU tensors, a model's state dict,
#    between two processes) and tests/bench/python_bench.py (Python against C++);
# 3. the raw libfabric tcp rate (ferry-bench engine) and NCCL send/recv (torch), the
#    baselines; then the table (OUT_DIR/table.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
bundle=${1:-.gpu-bundle}
out=${2:-${OUT:-/tmp/ferry-gpu}}
hmem=${3:-}
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
if [ -n "$hmem" ]; then
  echo "== correctness with a CUDA libfabric ($hmem)"
  FERRYD="$hmem/bin/ferryd" LD_LIBRARY_PATH="$hmem/lib:$LD_LIBRARY_PATH" "$hmem/bin/gpu_test" 2>&1 |
    tee "$out/gpu_test_hmem.log" | grep -E '^\[ +(OK|FAILED|SKIPPED|PASSED) ' || true
  if grep -q '^\[  FAILED  \]' "$out/gpu_test_hmem.log" || ! grep -q '^\[  PASSED  \]' "$out/gpu_test_hmem.log"; then
    echo "gpu_test (CUDA libfabric) failed"; tail -50 "$out/gpu_test_hmem.log"; exit 1
  fi
fi
if [ -f "$bundle/bin/libferry.so" ] && python3 -c "import torch" 2>/dev/null; then
  echo "== Python with torch"
  export FERRY_LIBRARY="$bundle/bin/libferry.so" PYTHONPATH="$PWD/python" FERRY_PULL_LOOP="$bundle/bin/ferry-pull-loop"
  if ! timeout 300 python3 tests/gpu/torch_test.py 2>&1 | tee "$out/torch_test.log" | grep -E '^(ok|FAIL|torch_test)'; then
    echo "torch_test did not run"; tail -30 "$out/torch_test.log"; exit 1
  fi
  grep -q '^torch_test: all passed' "$out/torch_test.log" || { tail -60 "$out/torch_test.log"; exit 1; }
  timeout 400 python3 tests/bench/python_bench.py --device cuda:0 --json | tee "$out/python_rows.jsonl" || true
fi
echo "== benchmark"
: > "$out/rows.jsonl"
timeout 400 "$bundle/bin/ferry-bench" gpu --ferryd "$FERRYD" --json | tee -a "$out/rows.jsonl"
if [ -n "$hmem" ]; then
  # The rdma rows: GPU memory on shm rails through FI_HMEM (the other rows are those above).
  LD_LIBRARY_PATH="$hmem/lib:$LD_LIBRARY_PATH" timeout 400 "$bundle/bin/ferry-bench" gpu --ferryd "$hmem/bin/ferryd" \
    --provider shm --staged false --json | grep '"path":"rdma"' | tee -a "$out/rows.jsonl" || true
fi
timeout 200 "$bundle/bin/ferry-bench" engine --provider tcp --domain lo --rails 2 \
  --piece 4194304 --total 1073741824 --layout contiguous --iters 3 --json | tee -a "$out/rows.jsonl"
timeout 300 python3 tests/gpu/nccl_bench.py $((1 << 30)) $((256 << 20)) | tee -a "$out/rows.jsonl" || true
python3 tests/gpu/summarize.py "$out/rows.jsonl" | tee "$out/table.md"
