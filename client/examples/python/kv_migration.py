#!/usr/bin/env python3
"""KV-cache migration: a prefill process publishes a request's KV pages (ephemeral), a decode
process pulls them into free pages of its own pool, prepared once, in one call per request.

    PYTHONPATH=python FERRY_LIBRARY=build/client/libferry.so \\
        python3 client/examples/python/kv_migration.py [--requests 5]
"""

import argparse
import json
import subprocess
import sys
import tempfile

import numpy as np

import ferry

PAGE = 16 * 1024       # bytes per KV page (all layers of a block of tokens, say)
POOL_PAGES = 1024


def prefill(requests: int) -> None:
    with (tempfile.TemporaryDirectory(prefix="prefill-") as data,
          ferry.Node(data, sync=False) as node):
        pool = np.zeros((POOL_PAGES, PAGE), np.uint8)
        region = node.register(pool)
        rng = np.random.default_rng(0)
        for r in range(requests):
            pages = rng.choice(POOL_PAGES, size=64, replace=False).astype(np.uint32)
            pool[pages] = rng.integers(0, 255, (len(pages), PAGE), dtype=np.uint8)  # "prefill"
            node.publish(f"kv/req-{r}", ferry.kv_pages(region, PAGE, pages), durable=False)
            digest = int(pool[pages].astype(np.uint64).sum())
            print(json.dumps({"url": node.url, "name": f"kv/req-{r}", "pages": len(pages),
                              "digest": digest}), flush=True)
            sys.stdin.readline()  # migrated: the pages may be reused
            node.remove(f"kv/req-{r}")


def decode() -> None:
    with (tempfile.TemporaryDirectory(prefix="decode-") as data,
          ferry.Node(data, sync=False) as node):
        pool = np.zeros((POOL_PAGES, PAGE), np.uint8)
        region = node.register(pool)
        free = list(range(POOL_PAGES))
        for line in sys.stdin:
            req = json.loads(line)
            mine = np.array([free.pop() for _ in range(req["pages"])], np.uint32)
            with node.prepare(ferry.kv_pages(region, PAGE, mine)) as slots:
                stats = node.pull(req["url"], req["name"], slots)
            digest = int(pool[mine].astype(np.uint64).sum())
            print(json.dumps({"bytes": stats.bytes, "seconds": stats.seconds, "via": stats.via,
                              "digest": digest}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--role", choices=["prefill", "decode"])
    args = ap.parse_args()
    if args.role == "prefill":
        return prefill(args.requests)
    if args.role == "decode":
        return decode()
    spawn = lambda *a: subprocess.Popen([sys.executable, __file__, *a], text=True,  # noqa: E731
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    p, d = spawn("--role", "prefill", "--requests", str(args.requests)), spawn("--role", "decode")
    ok = True
    for _ in range(args.requests):
        req = json.loads(p.stdout.readline())
        d.stdin.write(json.dumps(req) + "\n")
        d.stdin.flush()
        got = json.loads(d.stdout.readline())
        same = got["digest"] == req["digest"]
        ok &= same
        print(f"{req['name']}: {req['pages']} pages, {got['bytes']} bytes over {got['via']} in "
              f"{got['seconds'] * 1e6:.0f} us, {'identical' if same else 'DIFFERENT'}")
        p.stdin.write("\n")
        p.stdin.flush()
    for proc in (p, d):
        proc.stdin.close()
        proc.wait(60)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
