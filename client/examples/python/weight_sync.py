#!/usr/bin/env python3
"""Weight sync: a trainer process publishes its weights after each step, two replica processes
pull them into their own copies of the model, by tensor name.

    PYTHONPATH=python FERRY_LIBRARY=build/client/libferry.so \\
        python3 client/examples/python/weight_sync.py [--steps 3]

The weights are numpy arrays here; torch tensors (CPU or CUDA) work the same way.
"""

import argparse
import json
import subprocess
import sys
import tempfile

import numpy as np

import ferry


def weights(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"embed": rng.standard_normal((1000, 64)).astype(np.float32),
            "mlp.w": rng.standard_normal((64, 256)).astype(np.float32),
            "mlp.b": np.zeros(256, np.float32)}


def checksum(sd: dict) -> float:
    return float(sum(v.astype(np.float64).sum() for v in sd.values()))


def send(msg: dict) -> None:
    print(json.dumps(msg), flush=True)


def trainer(steps: int) -> None:
    with (tempfile.TemporaryDirectory(prefix="trainer-") as data,
          ferry.Node(data, sync=False) as node):
        sd = weights(0)
        for step in range(steps):
            for v in sd.values():
                v += 0.01 * (step + 1)  # "training": the tensors change in place
            info = ferry.publish_state_dict(node, "weights", sd, replace=step > 0)
            send({"url": node.url, "version": info["version"], "checksum": checksum(sd)})
            sys.stdin.readline()  # the replicas have pulled this version


def replica() -> None:
    with (tempfile.TemporaryDirectory(prefix="replica-") as data,
          ferry.Node(data, sync=False) as node):
        sd = weights(1)  # its own model: same shapes, other values
        for line in sys.stdin:
            want = json.loads(line)
            stats = ferry.pull_state_dict(node, want["url"], "weights", sd, version=want["version"])
            send({"version": stats.version, "bytes": stats.bytes, "path": stats.path,
                  "seconds": stats.seconds, "checksum": checksum(sd)})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--role", choices=["trainer", "replica"])
    args = ap.parse_args()
    if args.role == "trainer":
        return trainer(args.steps)
    if args.role == "replica":
        return replica()
    spawn = lambda *a: subprocess.Popen([sys.executable, __file__, *a], text=True,  # noqa: E731
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    t = spawn("--role", "trainer", "--steps", str(args.steps))
    replicas = [spawn("--role", "replica") for _ in range(2)]
    ok = True
    for _ in range(args.steps):
        step = json.loads(t.stdout.readline())
        for i, r in enumerate(replicas):
            r.stdin.write(json.dumps(step) + "\n")
            r.stdin.flush()
            got = json.loads(r.stdout.readline())
            same = abs(got["checksum"] - step["checksum"]) < 1e-6 * max(1, abs(step["checksum"]))
            ok &= same
            print(f"version {got['version']} -> replica {i}: {got['bytes']} bytes by {got['path']} "
                  f"in {got['seconds'] * 1e3:.2f} ms, weights {'match' if same else 'DIFFER'}")
        t.stdin.write("\n")
        t.stdin.flush()
    for p in [t, *replicas]:
        p.stdin.close()
        p.wait(60)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
