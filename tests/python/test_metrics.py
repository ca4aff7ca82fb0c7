"""GET /metrics: the text format checked by promtool, scraped by a real Prometheus (Debian's
package) from two ferryd during pulls, and what it says checked against what was moved."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

import ferry
import helpers
from helpers import pattern

MiB = 1 << 20
TOOLS_ENV = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
# Debian's prometheus package (deploy/install-deps.sh).
PROMETHEUS = shutil.which("prometheus") or "prometheus"
PROMTOOL = shutil.which("promtool") or "promtool"


def get(url, headers=None):
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def samples(text: str) -> dict[str, float]:
    """{'name{labels}': value} of an exposition."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


@pytest.fixture
def nodes(tmp_path):
    a = helpers.start_ferryd(tmp_path / "a", "--rails", "2")
    b = helpers.start_ferryd(tmp_path / "b", "--rails", "2")
    yield a, b
    assert b.stop() == 0
    assert a.stop() == 0


def test_the_exposition_passes_promtool_and_counts_a_pull_on_both_sides(nodes):
    a, b = nodes
    ferry.Client(a.url).put("w", pattern(3 * MiB))
    stats = ferry.Client(b.url).pull("w", a.url)
    assert stats.path == "rdma"
    for node in (a, b):
        status, text = get(node.url + "/metrics")
        assert status == 200
        check = subprocess.run([PROMTOOL, "check", "metrics"], input=text.encode(),
                               capture_output=True, env=TOOLS_ENV, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr
    src = samples(get(a.url + "/metrics")[1])
    dst = samples(get(b.url + "/metrics")[1])
    sent = sum(v for k, v in src.items() if k.startswith("ferry_rail_sent_bytes_total{"))
    assert sent == 3 * MiB
    assert src['ferry_pull_bytes_total{role="source",path="rdma"}'] == 3 * MiB
    assert src['ferry_pulls_total{role="source",path="rdma",outcome="ok"}'] == 1
    assert dst['ferry_pull_bytes_total{role="destination",path="rdma"}'] == 3 * MiB
    assert dst['ferry_pull_size_bytes_bucket{role="destination",le="4194304"}'] == 1
    assert dst['ferry_pull_size_bytes_bucket{role="destination",le="1048576"}'] == 0
    assert src['ferry_catalog_bytes{device="host"}'] == 3 * MiB
    assert dst['ferry_catalog_objects{device="host"}'] == 1
    assert src['ferry_http_requests_total{route="/v1/objects/{name}/data",code="201"}'] == 1
    round_trips = [k for k in dst if k.startswith("ferry_control_round_trip_seconds_count")]
    assert round_trips, "the destination counted no control round trip"
    assert dst["ferry_pulls_in_flight"] == 0
    # A failed pull counts as its outcome, not as bytes.
    with pytest.raises(ferry.NotFound):
        ferry.Client(b.url).pull("missing", a.url)
    dst = samples(get(b.url + "/metrics")[1])
    assert dst['ferry_pulls_total{role="destination",path="none",outcome="not_found"}'] == 1


def test_with_a_token_metrics_needs_it_unless_public(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    closed = helpers.start_ferryd(tmp_path / "c", "--token-file", str(token))
    public = helpers.start_ferryd(tmp_path / "p", "--token-file", str(token), "--metrics-public")
    try:
        assert get(closed.url + "/metrics")[0] == 401
        assert get(closed.url + "/metrics", {"Authorization": "Bearer s3cret"})[0] == 200
        assert get(public.url + "/metrics")[0] == 200
        # Only /metrics: the rest still wants the token.
        assert get(public.url + "/v1/objects")[0] == 401
    finally:
        assert closed.stop() == 0
        assert public.stop() == 0


class Prometheus:
    """A Prometheus on loopback scraping `targets` every 100 ms into `data`."""

    def __init__(self, data, targets: list[str]):
        self.port = helpers.free_port()
        config = data / "prometheus.yml"
        hosts = [t.removeprefix("http://") for t in targets]
        config.write_text(json.dumps({
            "global": {"scrape_interval": "100ms", "scrape_timeout": "100ms"},
            "scrape_configs": [{"job_name": "ferry", "static_configs": [{"targets": hosts}]}],
        }))
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={data / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=open(data / "prometheus.log", "w"), env=TOOLS_ENV)
        try:
            self.wait_for(lambda: len(self.targets()) == len(targets) and all(
                t["health"] == "up" for t in self.targets()), "targets up")
        except BaseException:
            self.stop()
            raise

    def targets(self) -> list[dict]:
        return self.api("targets").get("activeTargets", [])

    def api(self, path: str, **params):
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.loads(r.read())
        except OSError:
            return {}
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> dict[str, float]:
        """{instance: value} of an instant query."""
        result = self.api("query", query=expr).get("result", [])
        return {r["metric"].get("instance", ""): float(r["value"][1]) for r in result}

    def wait_for(self, condition, what: str, seconds: float = 60):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}")
            if condition():
                return
            time.sleep(0.05)
        raise AssertionError(f"prometheus: no {what} in {seconds} s")

    def last_scrapes(self) -> dict[str, str]:
        return {t["scrapeUrl"]: t["lastScrape"] for t in self.targets()}

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)


def test_prometheus_scrapes_two_nodes_during_pulls_and_sees_the_bytes_moved(nodes, tmp_path):
    a, b = nodes
    size, rounds = 8 * MiB, 4
    ferry.Client(a.url).put("w", pattern(size))
    prom = Prometheus(tmp_path, [a.url, b.url])
    try:
        client = ferry.Client(b.url)
        for i in range(rounds):
            client.pull("w", a.url, as_=f"copy{i}")
            # Each round lands in its own scrape of both nodes: the series has steps to rate.
            before = prom.last_scrapes()
            prom.wait_for(lambda: all(prom.last_scrapes()[u] != before[u] for u in before),
                          "new scrape")
        moved = size * rounds
        src, dst = a.url.removeprefix("http://"), b.url.removeprefix("http://")
        prom.wait_for(lambda: prom.query('sum by (instance) (ferry_rail_sent_bytes_total)')
                      .get(src) == moved, "source bytes")
        assert prom.query('ferry_pull_bytes_total{role="destination"}')[dst] == moved
        assert prom.query('ferry_pull_bytes_total{role="source"}')[src] == moved
        assert prom.query('ferry_pulls_total{role="destination",outcome="ok"}')[dst] == rounds
        rates = prom.query('sum by (instance) (rate(ferry_rail_sent_bytes_total[1m]))')
        assert rates[src] > 0
        assert prom.query('rate(ferry_pull_bytes_total{role="destination"}[1m])')[dst] > 0
        # Every scrape of both went through: up, and no target with an error.
        assert prom.query("up") == {src: 1.0, dst: 1.0}
        for t in prom.targets():
            assert t["health"] == "up" and t["lastError"] == "", t
    finally:
        prom.stop()
