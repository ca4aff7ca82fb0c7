#!/usr/bin/env python3
"""The directory's cost: what a pull by name adds, and etcd under a simulated fleet.

    cluster_bench.py [--json] [--iters N] [--rounds R] [--nodes N] [--holders M]
                     [--lookups L] [--renew-s S] [--directory etcd|embedded|both]

- by_name: two ferryd on loopback (tcp) with a directory (etcd started here from Debian's
  etcd-server, or a third ferryd with --serve-directory). B pulls a 4 KiB object of A's
  into a registered region over HTTP, once naming A (the baseline) and once by name (B asks
  the directory for the holders first), alternating round by round; p50 and p99 of each and
  what the lookup adds.
- fleet: etcd alone, holding --nodes node records under as many leases and --holders holder
  records (8 holders per object version), as ferry writes them: the time a holder lookup
  takes (p50, p99 over --lookups random objects), and how many lease renewals per second
  etcd answers (8 client threads for --renew-s seconds).

Needs ferryd (FERRYD, or FERRY_BUILD_DIR/server/ferryd) and etcd (ETCD, or etcd on PATH). Every loop is bounded
by its count and --max-seconds.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import random
import select
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
BUILD = Path(os.environ.get("FERRY_BUILD_DIR", ROOT / "build"))
FERRYD = os.environ.get("FERRYD", str(BUILD / "server" / "ferryd"))
ETCD = os.environ.get("ETCD", shutil.which("etcd") or "/usr/bin/etcd")
SIZE = 4096


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Http:
    """One kept-alive connection; post() returns (status, JSON)."""

    def __init__(self, url: str):
        host, port = url.split("://", 1)[1].rstrip("/").rsplit(":", 1)
        self.c = http.client.HTTPConnection(host, int(port), timeout=60)
        self.c.connect()
        self.c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        self.c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = self.c.getresponse()
        return r.status, json.loads(r.read() or b"{}")

    def put_bytes(self, path: str, data: bytes) -> int:
        self.c.request("PUT", path, data, {"Content-Type": "application/octet-stream"})
        r = self.c.getresponse()
        r.read()
        return r.status

    def get(self, path: str) -> tuple[int, dict]:
        self.c.request("GET", path)
        r = self.c.getresponse()
        return r.status, json.loads(r.read() or b"{}")


def wait_for(cond, what: str, seconds: float = 30):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except OSError:
            pass
        time.sleep(0.02)
    sys.exit(f"cluster_bench: no {what} in {seconds} s")


def start_etcd(tmp: Path) -> tuple[subprocess.Popen, str]:
    port, peer = free_port(), free_port()
    client, peer_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{peer}"
    p = subprocess.Popen([ETCD, "--name", "b", "--data-dir", str(tmp / "etcd"),
                          "--listen-client-urls", client, "--advertise-client-urls", client,
                          "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                          "--initial-cluster", f"b={peer_url}", "--quota-backend-bytes",
                          str(8 << 30)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: Http(client).post("/v3/kv/range", {"key": "eA=="})[0] == 200, "etcd")
    return p, client


def start_ferryd(tmp: Path, name: str, *extra: str) -> tuple[subprocess.Popen, dict]:
    p = subprocess.Popen([str(FERRYD), "--listen", "127.0.0.1:0", "--data-dir", str(tmp / name),
                          "--provider", "tcp", *extra], stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    ready, _, _ = select.select([p.stdout], [], [], 60)
    line = p.stdout.readline() if ready else ""
    if not line:
        sys.exit(f"cluster_bench: ferryd {name} did not start")
    return p, json.loads(line)


def stop(procs):
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def by_name(args, kind: str, tmp: Path) -> dict:
    procs = []
    try:
        if kind == "etcd":
            p, client = start_etcd(tmp)
            procs.append(p)
            directory = "etcd://" + client.split("://", 1)[1]
        else:
            p, info = start_ferryd(tmp, "directory", "--serve-directory")
            procs.append(p)
            directory = info["url"]
        flags = ("--directory", directory, "--rails", "1")
        pa, a = start_ferryd(tmp, "a", *flags)
        pb, b = start_ferryd(tmp, "b", *flags)
        procs += [pa, pb]
        ca, cb = Http(a["url"]), Http(b["url"])
        assert ca.put_bytes("/v1/objects/w/data", os.urandom(SIZE)) == 201
        status, region = cb.post("/v1/regions", {"size": SIZE})
        assert status == 201, region
        into = {"extents": [{"region": region["id"], "offset": 0, "length": SIZE}]}

        def holders() -> bool:
            nodes = cb.get("/v1/cluster")[1].get("nodes", [])
            return any(n["id"] == a["node"] and n["objects"] for n in nodes)

        wait_for(holders, "A holding w in the directory")
        named_body = {"from": a["url"], "object": "w", "into": into}
        name_body = {"object": "w", "into": into}
        for body in (named_body, name_body):  # sessions up, first contact paid
            for _ in range(20):
                status, stats = cb.post("/v1/pulls", body)
                assert status == 200, stats
        assert stats["source"] == a["url"], stats  # by name, from the one holder
        named, by = [], []
        deadline = time.monotonic() + args.max_seconds
        for r in range(args.rounds):
            order = [(named_body, named), (name_body, by)]
            if r % 2:
                order.reverse()
            for body, out in order:
                for _ in range(args.iters):
                    t = time.perf_counter()
                    status, stats = cb.post("/v1/pulls", body)
                    out.append((time.perf_counter() - t) * 1e6)
                    assert status == 200, stats
            if time.monotonic() > deadline:
                break
        n50, b50 = statistics.median(named), statistics.median(by)
        return {"bench": "pull_by_name", "directory": kind, "bytes": SIZE, "pulls": len(by),
                "named_p50_us": round(n50, 1), "named_p99_us": round(pct(named, 0.99), 1),
                "by_name_p50_us": round(b50, 1), "by_name_p99_us": round(pct(by, 0.99), 1),
                "added_p50_us": round(b50 - n50, 1), "ratio": round(b50 / n50, 3)}
    finally:
        stop(procs)


def b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def fleet(args, tmp: Path) -> dict:
    p, client = start_etcd(tmp)
    try:
        deadline = time.monotonic() + args.max_seconds
        objects = max(1, args.holders // 8)
        leases: list[str] = []
        lock = threading.Lock()

        def load(worker: int, workers: int):
            c = Http(client)
            for n in range(worker, args.nodes, workers):
                status, g = c.post("/v3/lease/grant", {"TTL": "3600"})  # outlives the load
                assert status == 200, g
                with lock:
                    leases.append(g["ID"])
                node = f"{n:016x}"
                c.post("/v3/kv/put", {"key": b64(f"ferry/nodes/{node}"), "lease": g["ID"],
                                      "value": b64(json.dumps({"id": node, "url": f"http://10.0.{n >> 8}.{n & 255}:7070"}))})
            for i in range(worker, args.holders, workers):
                if time.monotonic() > deadline:
                    return
                obj, holder = i // 8, (i * 131) % args.nodes
                key = f"ferry/objects/model/shard-{obj:07d}@{1:020d}/{holder:016x}"
                with lock:
                    lease = leases[holder % len(leases)] if leases else "0"
                c.post("/v3/kv/put", {"key": b64(key), "lease": lease,
                                      "value": b64('{"url":"http://10.0.0.1:7070","host":"h","size":1048576}')})

        t0 = time.monotonic()
        threads = [threading.Thread(target=load, args=(w, 8)) for w in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        load_s = time.monotonic() - t0
        c = Http(client)
        status, counted = c.post("/v3/kv/range", {"key": b64("ferry/objects/"),
                                                  "range_end": b64("ferry/objects0"),
                                                  "count_only": True})
        assert status == 200, counted
        count = int(counted.get("count", 0))
        rng = random.Random(1)
        lookups = []
        for _ in range(args.lookups):
            obj = rng.randrange(objects)
            prefix = f"ferry/objects/model/shard-{obj:07d}@"
            end = prefix[:-1] + chr(ord("@") + 1)
            t = time.perf_counter()
            status, r = c.post("/v3/kv/range", {"key": b64(prefix), "range_end": b64(end)})
            lookups.append((time.perf_counter() - t) * 1e6)
            assert status == 200
        renewals = [0] * 8
        stop_at = time.monotonic() + args.renew_s

        def renew(worker: int):
            c = Http(client)
            i = worker
            while time.monotonic() < stop_at:
                status, r = c.post("/v3/lease/keepalive", {"ID": leases[i % len(leases)]})
                assert status == 200, r
                renewals[worker] += 1
                i += 8

        threads = [threading.Thread(target=renew, args=(w,)) for w in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return {"bench": "directory_fleet", "directory": "etcd", "nodes": len(leases),
                "holders": count, "load_seconds": round(load_s, 1),
                "lookup_p50_us": round(statistics.median(lookups), 1),
                "lookup_p99_us": round(pct(lookups, 0.99), 1),
                "renewals_per_s": round(sum(renewals) / args.renew_s),
                "needed_per_s": round(len(leases) / (5 / 3))}
    finally:
        stop([p])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="one JSON object per row")
    ap.add_argument("--iters", type=int, default=200, help="timed pulls per round and kind")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--directory", default="both", choices=["etcd", "embedded", "both"])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--holders", type=int, default=100000)
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--renew-s", type=float, default=5.0)
    ap.add_argument("--no-fleet", action="store_true")
    ap.add_argument("--max-seconds", type=float, default=600, help="bound on each part's loop")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="ferry-cluster-bench-") as tmp:
        kinds = ["embedded", "etcd"] if args.directory == "both" else [args.directory]
        for i, kind in enumerate(kinds):
            d = Path(tmp) / f"by-name-{i}"
            d.mkdir()
            rows.append(by_name(args, kind, d))
        if not args.no_fleet:
            d = Path(tmp) / "fleet"
            d.mkdir()
            rows.append(fleet(args, d))
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    print("| directory | pull naming the source, p50 / p99 | pull by name, p50 / p99 | added p50 | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        if r["bench"] == "pull_by_name":
            print(f"| {r['directory']} | {r['named_p50_us']:.0f} / {r['named_p99_us']:.0f} us | "
                  f"{r['by_name_p50_us']:.0f} / {r['by_name_p99_us']:.0f} us | "
                  f"{r['added_p50_us']:+.0f} us | {r['ratio']:.2f} |")
    for r in rows:
        if r["bench"] == "directory_fleet":
            print(f"\netcd with {r['nodes']} node leases and {r['holders']} holder records "
                  f"(loaded in {r['load_seconds']} s): lookup p50 {r['lookup_p50_us']:.0f} us, "
                  f"p99 {r['lookup_p99_us']:.0f} us; {r['renewals_per_s']} renewals/s answered "
                  f"({r['needed_per_s']}/s needed by these nodes at a 5 s TTL)")


if __name__ == "__main__":
    main()
