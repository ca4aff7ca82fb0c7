"""Reads the JSON lines of tests/gpu/run.sh and prints the results table (markdown)."""
import json
import sys

rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
base = {r["what"]: r["gb_per_sec"] for r in rows
        if r.get("bench") == "gpu_baseline" and "pieces" not in r}
batched = {r["pieces"]: r["gb_per_sec"] for r in rows
           if r.get("bench") == "gpu_baseline" and r.get("what") == "batched_copy"}
relayed = {r["pieces"]: r["gb_per_sec"] for r in rows
           if r.get("bench") == "gpu_baseline" and r.get("what") == "batched_copy_relayed"}
per_piece = {r["pieces"]: r["gb_per_sec"] for r in rows
             if r.get("bench") == "gpu_baseline" and r.get("what") == "memcpy_peer_per_piece"}
nccl = {r["bytes"]: r["gb_per_sec"] for r in rows if r.get("bench") == "nccl" and "gb_per_sec" in r}
raw = [r for r in rows if "raw_mb_per_sec" in r]
raw_gbs = max((r["raw_mb_per_sec"] / 1e3 for r in raw), default=0)
pulls = [r for r in rows if r.get("bench") == "gpu_pull"]
peer = base.get("cudaMemcpyPeer", 0)
nccl_1g = nccl.get(1 << 30, 0)
print("| path | layout | into | pieces | GB/s end to end | GB/s copy | copy alone | copy vs cudaMemcpyPeer | copy vs NCCL | copy vs a cudaMemcpyPeerAsync per piece | target (on the copy) |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
contiguous = {}
for r in pulls:
    if r["pieces"] == 1:
        contiguous[r["path"]] = r["copy_gb_per_sec"]
for r in pulls:
    gbs = r["copy_gb_per_sec"]
    vs_nccl = f"{gbs / nccl_1g:.2f}x" if nccl_1g else "n/a"
    if r["path"] == "cuda_ipc":
        if r["pieces"] == 1 or r["piece_bytes"] >= 256 << 10:
            ok = gbs >= 0.95 * peer and (not nccl_1g or gbs >= nccl_1g)
            target = f"{'met' if ok else 'MISSED'}: >= 95% cudaMemcpyPeer and >= 1.0x NCCL"
        else:
            c = contiguous.get("cuda_ipc", 0)
            ok = c and gbs >= 0.9 * c
            target = f"{'met' if ok else 'MISSED'}: >= 90% of contiguous ({gbs / c * 100:.1f}%)" if c else ""
    else:
        ceiling = min(base.get("d2h_pinned", 0), raw_gbs) if raw_gbs else base.get("d2h_pinned", 0)
        ok = ceiling and gbs >= 0.8 * ceiling
        target = (f"{'met' if ok else 'MISSED'}: >= 80% of min(d2h, raw tcp) = {ceiling:.2f} GB/s"
                  f" ({gbs / ceiling * 100:.1f}%)") if ceiling else ""
    alone = f"{batched[r['pieces']]:.1f}" if r["path"] == "cuda_ipc" and r["pieces"] in batched else ""
    vs_pieces = f"{gbs / per_piece[r['pieces']]:.2f}x" if r["pieces"] in per_piece else ""
    print(f"| {r['path']} | {r['layout']} | {r.get('into', 'extents')} | {r['pieces']} x {r['piece_bytes'] >> 10} KiB | "
          f"{r['gb_per_sec']:.1f} | {gbs:.1f} | {alone} | {gbs / peer:.3f} | {vs_nccl} | "
          f"{vs_pieces} | {target} |")
print()
print("GB/s end to end: wall clock of POST /v1/pulls on the destination (HTTP, planning and the copy);")
print("into: the destination's extents in each request's JSON, or a destination prepared once (POST /v1/destinations);")
print("GB/s copy: the pull's own seconds (source side: from its plan to the last byte; staged: the")
print("destination's wall clock, rings included); copy alone: CudaCopyPieces in one process, no node")
print("(the kernel, as a pull does; relayed through the copy engines, not yet used by pulls: " +
      (", ".join(f"{n} pieces {v:.1f} GB/s" for n, v in sorted(relayed.items())) or "not run") + ").")
print()
print(f"Baselines in the same run: cudaMemcpyPeer {peer:.1f} GB/s; device -> pinned host "
      f"{base.get('d2h_pinned', 0):.1f} GB/s; NCCL send/recv " +
      (", ".join(f"{b >> 20} MiB {v:.1f} GB/s" for b, v in sorted(nccl.items())) or "not run") +
      f"; raw libfabric tcp (fi_write loop, lo) {raw_gbs:.2f} GB/s; a cudaMemcpyPeerAsync per "
      "piece (what a program without ferry does; the targets stay on the one cudaMemcpyPeer) " +
      (", ".join(f"{n} pieces {v:.1f} GB/s" for n, v in sorted(per_piece.items())) or "not run") +
      ".")
