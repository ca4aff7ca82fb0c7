#!/usr/bin/env python3
"""The Python package's cost over C++, and state dicts against one object.

    python_bench.py [--json] [--device host|cuda:N] [--iters N] [--rounds R] [--sd-mib M]

A source node runs in a process of its own (this script with --serve). In this process an
embedded node pulls from it, alternating round by round with the C++ baseline
(ferry-pull-loop, ferry::EmbeddedNode::Pull in a process of its own, same source, same pulls):

- python_pull: a 4 KiB object, and 16384 pages of 4 KiB (the layout built for every call, as
  a KV migration does), per-call p50 in Python and in C++, and the difference;
- python_state_dict: pull_state_dict of --tensors tensors (--sd-mib MiB in all, on --device)
  against the same bytes as one object pulled into one buffer, GB/s and the ratio; with the
  version known (as a trainer announces it) and of the latest (its table asked every time).

Needs ferry-pull-loop (FERRY_PULL_LOOP, or FERRY_BUILD_DIR/tests/bench/), the package on PYTHONPATH;
torch for a CUDA device. Every loop is bounded by --iters and --rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import ferry

PAGE = 4096
PAGES = 16384
ROOT = Path(__file__).resolve().parent.parent.parent
BUILD = Path(os.environ.get("FERRY_BUILD_DIR", ROOT / "build"))
PULL_LOOP = os.environ.get("FERRY_PULL_LOOP", str(BUILD / "tests" / "bench" / "ferry-pull-loop"))


def tensors_of(device: str, sizes: list[int], seed: int):
    """Tensors of these byte sizes: torch on a CUDA device, numpy on the host."""
    rng = np.random.default_rng(seed)
    arrays = [rng.integers(0, 255, size=n, dtype=np.uint8) for n in sizes]
    if device == "host":
        return arrays
    import torch
    return [torch.from_numpy(a).to(device) for a in arrays]


def zeros(device: str, n: int):
    if device == "host":
        return np.zeros(n, np.uint8)
    import torch
    return torch.zeros(n, dtype=torch.uint8, device=device)


def split(total: int, parts: int, seed: int) -> list[int]:
    """`parts` sizes (multiples of 256 bytes) that add up to `total`, of varied size."""
    rng = np.random.default_rng(seed)
    w = rng.uniform(0.2, 1.8, parts)
    sizes = [int(x) // 256 * 256 for x in w / w.sum() * total]
    sizes[-1] += total - sum(sizes)
    return sizes


def serve(args) -> None:
    node = ferry.Node(tempfile.mkdtemp(prefix="ferry-pybench-src-"), sync=False)
    node.publish("small", node.register(np.full(PAGE, 7, np.uint8)))
    pool = node.register(np.random.default_rng(1).integers(0, 255, PAGES * PAGE, dtype=np.uint8))
    ids = np.random.default_rng(2).permutation(PAGES).astype(np.uint32)
    node.publish("pages", ferry.kv_pages(pool, PAGE, ids), durable=False)
    total = args.sd_mib << 20
    sd = {f"layer{i}.weight": t for i, t in
          enumerate(tensors_of(args.device, split(total, args.tensors, 3), 4))}
    node.publish_state_dict("sd", sd)
    flat = zeros(args.device, total)
    node.publish("flat", node.register(flat))
    print(json.dumps({"url": node.url}), flush=True)
    sys.stdin.read()
    node.stop()


def p50_us(f, iters: int) -> float:
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        f()
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def cpp_p50_us(url: str, obj: str, nbytes: int, page: int, iters: int) -> float:
    with tempfile.TemporaryDirectory(prefix="ferry-pull-loop-") as d:
        out = subprocess.run([PULL_LOOP, "--from", url,
                              "--object", obj, "--bytes", str(nbytes), "--page", str(page),
                              "--iters", str(iters), "--warmup", "20", "--data-dir", d],
                             capture_output=True, text=True, timeout=600, check=True)
    return json.loads(out.stdout)["p50_us"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="one JSON object per row")
    ap.add_argument("--device", default="host")
    ap.add_argument("--iters", type=int, default=300, help="timed pulls per round (4 KiB)")
    ap.add_argument("--page-iters", type=int, default=30, help="timed pulls per round (pages)")
    ap.add_argument("--sd-iters", type=int, default=3, help="timed state-dict pulls per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sd-mib", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(args)

    src = subprocess.Popen([sys.executable, __file__, "--serve", "--device", args.device,
                            "--sd-mib", str(args.sd_mib), "--tensors", str(args.tensors)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([src.stdout], [], [], 300)
        line = src.stdout.readline() if ready else ""
        if not line:
            sys.exit("python_bench: the source did not start")
        url = json.loads(line)["url"]
        rows = run(args, url)
    finally:
        src.stdin.close()
        src.wait(60)
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    print(f"# python_bench, device {args.device}, source {url}; medians over {args.rounds} rounds")
    print("| row | Python | C++ / one object | difference | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        if r["bench"] == "python_pull":
            print(f"| {r['case']} pull, p50 | {r['python_us']:.1f} us | {r['cpp_us']:.1f} us | "
                  f"{r['overhead_us']:+.1f} us ({r['overhead_pct']:+.1f}%) | {r['ratio']:.3f} |")
        else:
            print(f"| state dict ({r['case']}), {r['tensors']} tensors, {r['bytes'] >> 20} MiB | "
                  f"{r['state_dict_gbps']:.2f} GB/s | {r['one_object_gbps']:.2f} GB/s | | "
                  f"{r['ratio']:.3f} |")


def run(args, url: str) -> list[dict]:
    rows = []
    with ferry.Node(tempfile.mkdtemp(prefix="ferry-pybench-"), sync=False) as node:
        small = node.register(np.zeros(PAGE, np.uint8))
        pool = node.register(np.zeros(PAGES * PAGE, np.uint8))
        ids = np.arange(PAGES, dtype=np.uint32)
        cases = [
            ("4 KiB", lambda: node.pull(url, "small", small), PAGE, 0, args.iters),
            (f"{PAGES} pages of 4 KiB",
             lambda: node.pull(url, "pages", ferry.kv_pages(pool, PAGE, ids)), PAGES * PAGE, PAGE,
             args.page_iters),
        ]
        for name, pull, nbytes, page, iters in cases:
            for _ in range(20):
                pull()
            py, cpp = [], []
            for _ in range(args.rounds):
                py.append(p50_us(pull, iters))
                cpp.append(cpp_p50_us(url, "small" if page == 0 else "pages", nbytes, page, iters))
            p, c = statistics.median(py), statistics.median(cpp)
            rows.append({"bench": "python_pull", "case": name, "python_us": p, "cpp_us": c,
                         "overhead_us": p - c, "overhead_pct": (p - c) / c * 100, "ratio": c / p,
                         "rounds_python_us": py, "rounds_cpp_us": cpp})

        total = args.sd_mib << 20
        sizes = split(total, args.tensors, 3)
        dest = {f"layer{i}.weight": zeros(args.device, n) for i, n in enumerate(sizes)}
        flat = node.register(zeros(args.device, total))
        version = ferry.pull_state_dict(node, url, "sd", dest).version
        flat_pull = lambda: node.pull(url, "flat", flat)  # noqa: E731
        for how, sd_pull in [
            ("version known", lambda: ferry.pull_state_dict(node, url, "sd", dest, version=version)),
            ("latest", lambda: ferry.pull_state_dict(node, url, "sd", dest)),
        ]:
            sd_pull()
            flat_pull()
            sd_s, flat_s = [], []
            for _ in range(args.rounds):
                sd_s.append(p50_us(sd_pull, args.sd_iters) / 1e6)
                flat_s.append(p50_us(flat_pull, args.sd_iters) / 1e6)
            a, b = statistics.median(sd_s), statistics.median(flat_s)
            rows.append({"bench": "python_state_dict", "case": how, "tensors": args.tensors,
                         "bytes": total, "device": args.device, "state_dict_gbps": total / a / 1e9,
                         "one_object_gbps": total / b / 1e9, "ratio": b / a,
                         "state_dict_us": a * 1e6, "one_object_us": b * 1e6,
                         "path": flat_pull().path})
    return rows


if __name__ == "__main__":
    main()
