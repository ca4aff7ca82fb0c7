"""NCCL send/recv GPU0 -> GPU1 between two processes (torch), the baseline of tests/gpu/run.sh.

Prints one JSON object per size: {"bench":"nccl","bytes":N,"gb_per_sec":R}. Needs 2 GPUs.
"""
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ITERS = 5


def run(rank, sizes, init_file, out):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="file://" + init_file, rank=rank, world_size=2)
    for size in sizes:
        buf = torch.empty(size, dtype=torch.uint8, device="cuda")
        times = []
        for i in range(ITERS + 1):
            dist.barrier()
            torch.cuda.synchronize()
            start = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
            else:
                dist.recv(buf, 0)
            torch.cuda.synchronize()
            if i > 0:
                times.append(time.perf_counter() - start)
        if rank == 1:
            times.sort()
            out.put({"bench": "nccl", "bytes": size,
                     "gb_per_sec": size / times[len(times) // 2] / 1e9})
    dist.destroy_process_group()


def main():
    sizes = [int(s) for s in sys.argv[1:]] or [1 << 30]
    if torch.cuda.device_count() < 2:
        print(json.dumps({"bench": "nccl", "skipped": "needs 2 GPUs"}))
        return
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init_file = os.path.join(tempfile.mkdtemp(), "nccl-init")
    procs = [ctx.Process(target=run, args=(r, sizes, init_file, out)) for r in range(2)]
    for p in procs:
        p.start()
    for _ in sizes:
        print(json.dumps(out.get(timeout=300)), flush=True)
    for p in procs:
        p.join(timeout=60)


if __name__ == "__main__":
    main()
