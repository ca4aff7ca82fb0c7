#!/usr/bin/env python3
"""What HTTPS costs on ferryd's port: GET and PUT of an object's bytes with curl, over TLS
(--tls-cert, --tls-key) against plain HTTP on the same machine, the baseline, run by run.

    tls_bench.py [--json] [--mib N] [--runs R]

Two ferryd run side by side (one with a certificate made for the run); each run uploads
--mib MiB to each and reads it back, alternating. The table gives the median MB/s of each and
the ratio HTTPS / HTTP. Needs ferryd (FERRYD, or FERRY_BUILD_DIR/server/ferryd), curl and
openssl. Every loop is bounded by --runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
BUILD = Path(os.environ.get("FERRY_BUILD_DIR", ROOT / "build"))
FERRYD = os.environ.get("FERRYD", str(BUILD / "server" / "ferryd"))


def start(data: Path, *extra: str):
    p = subprocess.Popen([FERRYD, "--listen", "127.0.0.1:0", "--data-dir", str(data),
                          "--provider", "tcp", *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    info = json.loads(p.stdout.readline())
    return p, info["url"]


def curl(*args: str) -> float:
    """Seconds curl took."""
    t = time.perf_counter()
    subprocess.run(["curl", "-sS", "--fail", "--max-time", "120", *args], check=True,
                   stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        cert, key = t / "cert.pem", t / "key.pem"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                        "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out",
                        str(cert), "-subj", "/CN=127.0.0.1", "-addext",
                        "subjectAltName=IP:127.0.0.1", "-days", "1"],
                       check=True, capture_output=True)
        blob = t / "blob"
        blob.write_bytes(os.urandom(a.mib << 20))
        plain, plain_url = start(t / "plain")
        tls, tls_url = start(t / "tls", "--tls-cert", str(cert), "--tls-key", str(key))
        times: dict[tuple[str, str], list[float]] = {}
        try:
            for run in range(a.runs):
                for name, url, ca in (("http", plain_url, []), ("https", tls_url,
                                                                ["--cacert", str(cert)])):
                    obj = f"{url}/v1/objects/b{run}/data"
                    times.setdefault(("PUT", name), []).append(
                        curl(*ca, "-X", "PUT", "--data-binary", f"@{blob}", obj))
                    times.setdefault(("GET", name), []).append(curl(*ca, "-o", os.devnull, obj))
        finally:
            for p in (plain, tls):
                p.terminate()
                p.wait(timeout=60)
    rows = []
    for op in ("PUT", "GET"):
        http = (a.mib << 20) / statistics.median(times[(op, "http")]) / 1e6
        https = (a.mib << 20) / statistics.median(times[(op, "https")]) / 1e6
        rows.append({"bench": "tls", "op": op, "mib": a.mib, "runs": a.runs,
                     "https_MBps": round(https), "http_MBps": round(http),
                     "ratio": round(https / http, 2)})
    if a.json:
        for r in rows:
            print(json.dumps(r))
    else:
        print(f"{'op':<4} {'MiB':>5} {'HTTPS MB/s':>11} {'HTTP MB/s':>10} {'ratio':>6}")
        for r in rows:
            print(f"{r['op']:<4} {r['mib']:>5} {r['https_MBps']:>11} {r['http_MBps']:>10} "
                  f"{r['ratio']:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
