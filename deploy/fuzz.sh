#!/usr/bin/env bash
# Fuzzing (docs/security.md): builds the fuzz targets of tests/fuzz with clang, libFuzzer,
# AddressSanitizer and UndefinedBehaviorSanitizer, then runs each for FERRY_FUZZ_SECONDS
# (default 60), two at a time, from its committed corpus (tests/fuzz/corpus/<target>). A crash,
# a leak, a hang or a failed check ends with the input under <build>/crashes and exit 1.
#   bash deploy/fuzz.sh [TARGET...]   (default: all; names as in tests/fuzz/CMakeLists.txt)
#   FERRY_BUILD_DIR     build folder (default: build-fuzz)
#   FERRY_FUZZ_MERGE=1  then adds what the runs found to the committed corpus (minimized)
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install-deps.sh
dir=${FERRY_BUILD_DIR:-build-fuzz}
seconds=${FERRY_FUZZ_SECONDS:-60}
CC=clang CXX=clang++ cmake -S . -B "$dir" -G Ninja -DFERRY_FUZZ=ON \
  -DFERRY_SANITIZE=address,undefined -DFERRY_CUDA=OFF -DFERRY_WERROR=ON > /dev/null
if [ $# -gt 0 ]; then
  targets=("$@")
else
  read -ra targets <<< "$(sed -n 's/^set(FUZZ_TARGETS \(.*\))$/\1/p' tests/fuzz/CMakeLists.txt)"
fi
ninja -C "$dir" "${targets[@]/%/_fuzz}"
found=$(mktemp -d)
trap 'rm -rf "$found"' EXIT
mkdir -p "$dir/crashes"
fuzz() {  # one target: new inputs go to $found/<target>, the committed corpus is only read
  local t=$1
  mkdir -p "$found/$t"
  "$dir/tests/fuzz/${t}_fuzz" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$dir/crashes/$t-" "$found/$t" "tests/fuzz/corpus/$t" \
    > "$dir/fuzz-$t.log" 2>&1
}
failed=0
for ((i = 0; i < ${#targets[@]}; i += 2)); do
  pids=()
  for t in "${targets[@]:i:2}"; do
    fuzz "$t" &
    pids+=("$!")
  done
  for p in "${pids[@]}"; do wait "$p" || failed=1; done
done
printf '%-14s %12s %9s %8s  %s\n' target inputs "inputs/s" corpus result
for t in "${targets[@]}"; do
  log=$dir/fuzz-$t.log
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  committed=$(find "tests/fuzz/corpus/$t" -type f | wc -l)
  result=ok
  grep -qE "^==[0-9]+==ERROR|FUZZ_CHECK failed|^SUMMARY: |deadly signal|ALARM: working on the last Unit" \
    "$log" && result="FAILED (see $log)"
  printf '%-14s %12s %9s %8s  %s\n' "$t" "${runs:-?}" "$(( ${runs:-0} / seconds ))" "$committed" "$result"
  if [ "$result" != ok ]; then
    failed=1
    tail -30 "$log"
  elif [ "${FERRY_FUZZ_MERGE:-0}" = 1 ]; then
    "$dir/tests/fuzz/${t}_fuzz" -merge=1 "tests/fuzz/corpus/$t" "$found/$t" > /dev/null 2>&1
  fi
done
exit "$failed"
