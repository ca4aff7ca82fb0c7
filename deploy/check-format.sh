#!/usr/bin/env bash
# CI: every C++ and CUDA file of the repository is as clang-format (.clang-format) writes it.
# Prints the files that are not, with the diff, and fails; `bash deploy/check-format.sh --fix`
# rewrites them.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v clang-format > /dev/null || { echo "check-format: no clang-format (apt-get install clang-format)"; exit 1; }
mapfile -t files < <(git ls-files '*.cc' '*.h' '*.cu')
if [ "${1:-}" = --fix ]; then
  clang-format -i "${files[@]}"
  exit 0
fi
bad=0
for f in "${files[@]}"; do
  if ! clang-format --dry-run --Werror "$f" > /dev/null 2>&1; then
    echo "check-format: $f is not formatted:"
    clang-format "$f" | diff -u "$f" - | head -40 || true
    bad=1
  fi
done
[ "$bad" = 0 ] && echo "check-format: ${#files[@]} files formatted"
exit "$bad"
