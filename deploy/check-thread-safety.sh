#!/usr/bin/env bash
# CI: clang's thread-safety analysis (-Wthread-safety) over the project's own sources, with
# the flags of an existing build (its compile_commands.json), syntax only: the ABSL_GUARDED_BY
# and ABSL_EXCLUSIVE_LOCKS_REQUIRED annotations must hold. Tests and CUDA files are left out.
#   bash deploy/check-thread-safety.sh [BUILD_DIR]   (default: build)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
command -v clang++ > /dev/null || { echo "check-thread-safety: no clang++ (apt-get install clang)"; exit 1; }
[ -f "$build/compile_commands.json" ] || { echo "check-thread-safety: no $build/compile_commands.json"; exit 1; }
python3 - "$build" <<'PY'
import json, os, shlex, subprocess, sys
from concurrent.futures import ThreadPoolExecutor
build = sys.argv[1]
root = os.getcwd()
dirs = ("base/", "wire/", "engine/", "server/", "cluster/", "client/", "metadata/")
jobs = []
for e in json.load(open(os.path.join(build, "compile_commands.json"))):
    rel = os.path.relpath(e["file"], root)
    if not rel.startswith(dirs) or not rel.endswith(".cc"):
        continue
    args = shlex.split(e["command"])[1:]
    keep, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("-o", "-c"):
            skip = a == "-o"
            continue
        if a == e["file"]:
            continue
        keep.append(a)
    jobs.append((rel, ["clang++", "-fsyntax-only", "-Wthread-safety", "-Werror=thread-safety",
                       "-Wno-unknown-warning-option", *keep, e["file"]], e["directory"]))
def run(job):
    rel, cmd, cwd = job
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    return rel, p.returncode, p.stderr
failed = 0
with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
    for rel, rc, err in pool.map(run, jobs):
        if rc != 0:
            failed += 1
            print(f"check-thread-safety: {rel}:\n{err}")
print(f"check-thread-safety: {len(jobs) - failed} of {len(jobs)} files pass")
sys.exit(1 if failed else 0)
PY
