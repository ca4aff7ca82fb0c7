#!/usr/bin/env python3
"""The Python package with torch on a GPU machine (tests/gpu/run.sh runs it):

- CUDA tensors published by one process and pulled into another's CUDA tensors (same host:
  the cuda_ipc path), compared with torch.equal;
- the state dict of a small model built here (random weights, no download) moved into another
  process's model of the same shape, every tensor torch.equal;
- CPU tensors the same way (the rdma path).

Prints one line per check ("ok NAME" / "FAIL NAME: why") and exits 1 if any failed.
Needs FERRY_LIBRARY (or the package's own search) and torch with CUDA.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import tempfile
import traceback

import torch

import ferry


def model(seed: int, device: str) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Embedding(512, 64), torch.nn.Linear(64, 256),
                            torch.nn.LayerNorm(256), torch.nn.Linear(256, 64))
    m = m.to(device)
    m.get_submodule("1").to(torch.bfloat16)  # a dtype numpy lacks
    return m


def tensors(device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "f32": torch.randn(1024, 1024, generator=g).to(device),
        "i64": torch.randint(0, 1 << 40, (4096,), generator=g).to(device),
        "f16": torch.randn(333, generator=g).half().to(device),
        "empty": torch.zeros(0, 8).to(device),
    }


def serve(device: str) -> None:
    node = ferry.Node(tempfile.mkdtemp(prefix="ferry-torch-src-"), sync=False)
    node.publish_state_dict("tensors", tensors(device))
    node.publish_state_dict("model", model(1, device).state_dict())
    print(json.dumps({"url": node.url}), flush=True)
    sys.stdin.read()
    node.stop()


def check_device(device: str, want_path: str) -> list[str]:
    failed = []
    src = subprocess.Popen([sys.executable, __file__, "--serve", device], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([src.stdout], [], [], 120)
        url = json.loads(src.stdout.readline())["url"] if ready else sys.exit("no source")
        with ferry.Node(tempfile.mkdtemp(prefix="ferry-torch-dst-"), sync=False) as node:
            for name, run in [
                (f"tensors {device}", lambda: tensors_into(node, url, device, want_path)),
                (f"state dict of a model {device}", lambda: model_into(node, url, device, want_path)),
                (f"mismatch named {device}", lambda: mismatch(node, url, device)),
            ]:
                try:
                    run()
                    print(f"ok {name}", flush=True)
                except Exception:  # noqa: BLE001 - every failure is reported
                    print(f"FAIL {name}: {traceback.format_exc()}", flush=True)
                    failed.append(name)
    finally:
        src.stdin.close()
        src.wait(60)
    return failed


def tensors_into(node: ferry.Node, url: str, device: str, want_path: str) -> None:
    want = tensors(device)
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    stats = ferry.pull_state_dict(node, url, "tensors", got)
    assert stats.path == want_path, stats
    for k in want:
        assert torch.equal(got[k], want[k]), k


def model_into(node: ferry.Node, url: str, device: str, want_path: str) -> None:
    want, mine = model(1, device), model(2, device)
    assert not all(torch.equal(a, b) for a, b in zip(want.state_dict().values(),
                                                     mine.state_dict().values()))
    stats = ferry.pull_state_dict(node, url, "model", mine.state_dict())
    assert stats.path == want_path, stats
    for (k, a), b in zip(want.state_dict().items(), mine.state_dict().values()):
        assert torch.equal(a, b), k
    x = torch.randint(0, 512, (3,), device=device)
    with torch.no_grad():
        assert torch.equal(want[0](x), mine[0](x))


def mismatch(node: ferry.Node, url: str, device: str) -> None:
    sd = model(2, device).state_dict()
    sd["1.weight"] = torch.zeros(256, 64, dtype=torch.float32, device=device)
    try:
        ferry.pull_state_dict(node, url, "model", sd)
    except ferry.InvalidArgument as e:
        assert "tensor '1.weight': dtype F32 here, BF16" in str(e), e
        return
    raise AssertionError("a dtype mismatch was not refused")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        return serve(sys.argv[2])
    assert torch.cuda.is_available(), "no CUDA"
    failed = check_device("cuda:0", "cuda_ipc") + check_device("cpu", "rdma")
    print(f"torch_test: {'FAILED ' + ', '.join(failed) if failed else 'all passed'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
