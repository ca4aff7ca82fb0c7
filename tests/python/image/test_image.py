"""The container image (deploy/image/build.sh): built here from Debian's packages, run with
podman on the host's network, healthy, an object pulled into it from a ferryd outside it over
tcp on loopback, stopped with SIGTERM (drain logged, exit 0)."""

from __future__ import annotations

import os
import subprocess
import time

import ferry
import helpers
from helpers import call, free_port, pattern

MiB = 1 << 20
ROOT = helpers.HERE.parent.parent
TOOLS_ENV = helpers.TOOLS_ENV
# runc: crun refuses this machine's hybrid cgroup hierarchy. Limits no higher than the
# machine's own: podman would raise them, which a container here may not do.
PODMAN = ["podman", "--runtime", "runc"]
LIMITS = ["--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096"]


def run(*argv, timeout=600, check=True):
    r = subprocess.run(list(argv), capture_output=True, text=True, env=TOOLS_ENV, timeout=timeout)
    if check:
        assert r.returncode == 0, f"{argv}: {r.stdout[-2000:]} {r.stderr[-2000:]}"
    return r


def test_the_image_serves_a_pull_and_drains_on_sigterm(tmp_path):
    built = run("bash", str(ROOT / "deploy" / "image" / "build.sh"), str(tmp_path / "image"))
    reference = built.stdout.strip().splitlines()[-1]
    image = run(*PODMAN, "pull", "-q", reference).stdout.strip().splitlines()[-1]
    port = free_port()
    name = f"ferry-image-test-{os.getpid()}"
    outside = helpers.start_ferryd(tmp_path / "outside")
    try:
        run(*PODMAN, "run", "-d", "--name", name, "--network", "host", *LIMITS, image,
            "--listen", f"127.0.0.1:{port}", "--data-dir", "/var/lib/ferry", "--provider", "tcp",
            "--domain", "lo")
        url = f"http://127.0.0.1:{port}"
        # Its health check, run inside it as the image's user.
        deadline = time.monotonic() + 60
        while run(*PODMAN, "exec", name, "ferry", "--node", url, "health",
                  check=False).returncode != 0:
            assert time.monotonic() < deadline, run(*PODMAN, "logs", name, check=False).stderr
            time.sleep(0.1)
        assert run(*PODMAN, "exec", name, "id", "-u").stdout.strip() == "10001"
        data = pattern(4 * MiB)
        ferry.Client(outside.url).put("w", data)
        status, _, stats = call(url + "/v1/pulls", "POST",
                                {"from": outside.url, "object": "w", "into": {"device": "host"}})
        assert status == 200 and stats["bytes"] == 4 * MiB and stats["path"] == "rdma", stats
        assert ferry.Client(url).get("w") == data.tobytes()
        run(*PODMAN, "stop", "-t", "30", name)
        state = run(*PODMAN, "inspect", name, "--format", "{{.State.ExitCode}}").stdout.strip()
        assert state == "0"
        assert "draining" in run(*PODMAN, "logs", name).stderr
    finally:
        run(*PODMAN, "rm", "-f", name, check=False)
        run(*PODMAN, "rmi", "-f", image, check=False)
        assert outside.stop() == 0
