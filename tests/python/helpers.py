"""What the Python tests and their peer processes share: byte patterns, a state dict, and
starting processes that print one JSON line when they are ready."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
BUILD = Path(os.environ.get("FERRY_BUILD_DIR", HERE.parent.parent / "build"))
FERRYD = BUILD / "server" / "ferryd"
FERRY_CLI = BUILD / "client" / "ferry"
PAGE = 4096


def pattern(n_bytes: int, seed: int = 1) -> np.ndarray:
    """`n_bytes` bytes (a multiple of 4) that differ at every word and with the seed."""
    i = np.arange(n_bytes // 4, dtype=np.uint64)
    return ((i * 2654435761 + seed * 40503) % (1 << 32)).astype(np.uint32).view(np.uint8)


def state_dict(seed: int = 1) -> dict[str, np.ndarray]:
    """A small model's weights in several dtypes, one of them empty."""
    rng = np.random.default_rng(seed)
    return {
        "embed.weight": rng.standard_normal((64, 32)).astype(np.float32),
        "layer0.weight": rng.standard_normal((32, 32)).astype(np.float16),
        "layer0.bias": rng.standard_normal(32),  # float64
        "layer0.steps": rng.integers(0, 1 << 40, size=(3,), dtype=np.int64),
        "layer0.mask": rng.integers(0, 2, size=(7,)).astype(bool),
        "layer0.empty": np.zeros((0, 4), dtype=np.float32),
        "head.codes": rng.integers(0, 255, size=(5, 3), dtype=np.uint8),
    }


def zeros_like(sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.zeros_like(v) for k, v in sd.items()}


class Ready:
    """A child process that prints one JSON line once ready; stopped by closing its stdin, or
    killed after `grace` seconds."""

    def __init__(self, argv: list[str], timeout: float = 60.0, grace: float = 20.0):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=None, text=True)
        self.grace = grace
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.stop()
            raise RuntimeError(f"{argv[0]} did not start (exit {self.proc.poll()})")
        self.info = json.loads(line)

    def stop(self) -> int:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
            if "ferryd" in self.proc.args[0]:
                self.proc.terminate()
            try:
                self.proc.wait(self.grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP, returning once every thread of `pid` is stopped (the signal lands later than
    kill returns)."""
    import glob
    import signal
    import time
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for stat in glob.glob(f"/proc/{pid}/task/*/stat"):
            try:
                states.append(Path(stat).read_text().rsplit(")", 1)[1].split()[0])
            except (OSError, IndexError):
                pass
        if states and all(s in ("T", "t") for s in states):
            return
        time.sleep(0.001)
    raise RuntimeError(f"process {pid} did not stop")


# For curl and other tools the tests run: without the sanitizer runtime the ASan build
# preloads into python3 (it hangs them).
TOOLS_ENV = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


def start_ferryd(data_dir: Path, *extra: str) -> Ready:
    r = Ready([str(FERRYD), "--listen", "127.0.0.1:0", "--data-dir", str(data_dir),
               "--provider", "tcp", *extra])
    r.url = "http://" + r.info["listen"]
    return r


def start_peer(mode: str, data_dir: Path) -> Ready:
    r = Ready([sys.executable, str(HERE / "peer.py"), mode, str(data_dir)])
    r.url = r.info["url"]
    return r


def call(url, method="GET", body=None, headers=None):
    """(status, headers, JSON or text) of one request."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, method=method, data=data,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, h, raw = r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        status, h, raw = e.code, e.headers, e.read()
    try:
        return status, h, json.loads(raw)
    except ValueError:
        return status, h, raw


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def auth(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"} if token else {}


def pulls_in_flight(node, token: str = "") -> float:
    _, _, text = call(node.url + "/metrics", headers=auth(token))
    for line in text.decode().splitlines():
        if line.startswith("ferry_pulls_in_flight "):
            return float(line.split()[1])
    raise AssertionError("no ferry_pulls_in_flight")


def wait_until(condition, what: str, seconds: float = 30):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError(f"no {what} in {seconds} s")


class HeldPull:
    """A pull from `source` into a region of `dest`, held in flight: the source is stopped once
    the destination counts the pull (it sent the request: the session exists, the layout
    needs no question), and goes on when `release` is called. The first contact before it
    publishes the object on `dest` as `warm`."""

    def __init__(self, source, dest, size: int, token: str = "", warm: str = "warm"):
        self.source = source
        status, _, region = call(dest.url + "/v1/regions", "POST", {"size": size}, auth(token))
        assert status == 201, region
        # First contact, so that the held pull asks nothing of the source before it goes.
        status, _, _ = call(dest.url + "/v1/pulls", "POST",
                            {"from": source.url, "object": "w", "into": {"device": "host"},
                             "as": warm}, auth(token))
        assert status == 200
        stop_process(source.proc.pid)
        self.result = None
        body = {"from": source.url, "object": "w",
                "into": {"extents": [{"region": region["id"], "offset": 0, "length": size}]}}
        self.thread = threading.Thread(target=lambda: setattr(
            self, "result", call(dest.url + "/v1/pulls", "POST", body, auth(token))))
        self.thread.start()
        wait_until(lambda: pulls_in_flight(dest, token) == 1, "pull in flight")

    def release(self):
        os.kill(self.source.proc.pid, signal.SIGCONT)

    def join(self):
        self.thread.join(60)
        assert not self.thread.is_alive()
        return self.result
