#!/usr/bin/env python3
"""REST fetch: upload bytes to a node and read them back, first with ferry.Client, then with
nothing but the standard library's HTTP client (what any program or curl does).

    PYTHONPATH=python FERRY_LIBRARY=build/client/libferry.so \\
        python3 client/examples/python/rest_fetch.py [--node http://127.0.0.1:7070]

Without --node it starts a node in this process.
"""

import argparse
import sys
import tempfile
import urllib.parse
import urllib.request

import ferry


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--node", help="a running ferryd (default: one started here)")
    args = ap.parse_args()
    data_dir = None if args.node else tempfile.TemporaryDirectory(prefix="rest-")
    node = ferry.Node(data_dir.name, sync=False) if data_dir else None
    url = args.node or node.url
    data = bytes(range(256)) * 4096  # 1 MiB
    with ferry.Client(url) as c:
        info = c.put("examples/blob", data, replace=True, meta={"content": "test pattern"})
        print(f"put {info['name']} version {info['version']}, {info['size']} bytes, "
              f"meta {c.stat('examples/blob')['meta']}")
        assert c.get("examples/blob") == data
    name = urllib.parse.quote("examples/blob", safe="")
    req = urllib.request.Request(f"{url}/v1/objects/{name}/data", headers={"Range": "bytes=256-511"})
    with urllib.request.urlopen(req) as r:
        part = r.read()
        print(f"GET with Range: {r.status}, {len(part)} bytes, "
              f"{'as uploaded' if part == data[256:512] else 'DIFFERENT'}")
    if node:
        node.stop()
        data_dir.cleanup()
    sys.exit(0 if part == data[256:512] else 1)


if __name__ == "__main__":
    main()
