"""What the Python tests and their peer processes share: byte patterns, a state dict, and
starting processes that print one JSON line when they are ready."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
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


def start_ferryd(data_dir: Path, *extra: str) -> Ready:
    r = Ready([str(FERRYD), "--listen", "127.0.0.1:0", "--data-dir", str(data_dir),
               "--provider", "tcp", *extra])
    r.url = "http://" + r.info["listen"]
    return r


def start_peer(mode: str, data_dir: Path) -> Ready:
    r = Ready([sys.executable, str(HERE / "peer.py"), mode, str(data_dir)])
    r.url = r.info["url"]
    return r
