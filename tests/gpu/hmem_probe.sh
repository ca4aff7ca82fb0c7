#!/usr/bin/env bash
# GPU memory on the rails (FI_HMEM) by hand, on a GPU machine: two ferryd from BUNDLE on one
# provider (shm, or tcp on lo), a 64 MiB object uploaded to cuda:0 on A and pulled by B into
# cuda:0 on each path (rdma, auto, staged) and into host memory over rdma, every result
# compared with the upload. Prints what each rail says about GPU memory and each pull's stats;
# libfabric's warnings go to OUT_DIR/{a,b}-PROVIDER.log.
#
#   bash tests/gpu/hmem_probe.sh BUNDLE OUT_DIR [shm|tcp]
set -uo pipefail
bundle=$1; out=$2; provider=${3:-shm}
mkdir -p "$out"
# shellcheck disable=SC1091
source "$bundle/env.sh"
export FI_LOG_LEVEL=warn
dir=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; wait; rm -rf "$dir"' EXIT
args=(--provider "$provider" --rails 2)
[ "$provider" = tcp ] && args+=(--domain lo)
"$bundle/bin/ferryd" --listen 127.0.0.1:7401 --data-dir "$dir/a" "${args[@]}" > /dev/null 2> "$out/a-$provider.log" &
"$bundle/bin/ferryd" --listen 127.0.0.1:7402 --data-dir "$dir/b" "${args[@]}" > /dev/null 2> "$out/b-$provider.log" &
for _ in $(seq 50); do curl -sf localhost:7402/v1/health > /dev/null && curl -sf localhost:7401/v1/health > /dev/null && break; sleep 0.1; done
curl -s localhost:7402/v1/node | python3 -c 'import json, sys
for r in json.load(sys.stdin)["rails"]: print(r["provider"], "hmem_cuda", r["hmem_cuda"], "hmem_dmabuf", r.get("hmem_dmabuf"), r.get("hmem_cuda_error", ""))'
head -c $((64 << 20)) /dev/urandom > "$dir/w.bin"
curl -s -X PUT -H 'Content-Type: application/octet-stream' --data-binary @"$dir/w.bin" \
  "localhost:7401/v1/objects/w/data?device=cuda:0" > /dev/null
pull() {  # AS DEVICE PATH
  echo "== into $2, path $3"
  curl -s -X POST -d "{\"from\":\"http://127.0.0.1:7401\",\"object\":\"w\",\"as\":\"$1\",\"into\":{\"device\":\"$2\"},\"path\":\"$3\"}" \
    localhost:7402/v1/pulls
  echo
  curl -s "localhost:7402/v1/objects/$1/data" | cmp -s - "$dir/w.bin" && echo "bytes match" || echo "BYTES DIFFER"
}
pull w-rdma cuda:0 rdma
pull w-auto cuda:0 auto
pull w-staged cuda:0 staged
pull w-host host rdma
