"""Limits that refuse cleanly (issue 28): the host memory budget (--memory-limit-mb)."""

from __future__ import annotations

import pytest

import ferry
import helpers
from helpers import call, pattern

MiB = 1 << 20


@pytest.fixture
def small(tmp_path):
    d = helpers.start_ferryd(tmp_path / "small", "--memory-limit-mb", "64")
    yield d
    assert d.stop() == 0


def test_regions_past_the_memory_limit_are_refused_until_memory_is_freed(small):
    status, _, first = call(small.url + "/v1/regions", "POST", {"size": 48 * MiB})
    assert status == 201, first
    status, _, body = call(small.url + "/v1/regions", "POST", {"size": 48 * MiB})
    assert status == 429 and body["error"]["code"] == "RESOURCE_EXHAUSTED", body
    assert "memory limit" in body["error"]["message"]
    assert len(call(small.url + "/v1/regions")[2]["regions"]) == 1  # nothing changed
    assert call(small.url + f"/v1/regions/{first['id']}", "DELETE")[0] == 200
    assert call(small.url + "/v1/regions", "POST", {"size": 48 * MiB})[0] == 201


def test_uploads_and_pulls_into_new_buffers_past_it_are_refused(small, tmp_path):
    with pytest.raises(ferry.ResourceExhausted):
        ferry.Client(small.url).put("big", pattern(80 * MiB))
    assert call(small.url + "/v1/objects/big")[0] == 404
    source = helpers.start_ferryd(tmp_path / "source")
    try:
        ferry.Client(source.url).put("big", pattern(80 * MiB))
        status, _, body = call(small.url + "/v1/pulls", "POST",
                               {"from": source.url, "object": "big", "into": {"device": "host"}})
        assert status == 429 and "memory limit" in body["error"]["message"], body
        assert call(small.url + "/v1/objects/big")[0] == 404
        # What fits still goes.
        ferry.Client(source.url).put("fits", pattern(16 * MiB))
        stats = ferry.Client(small.url).pull("fits", source.url)
        assert stats.bytes == 16 * MiB
    finally:
        assert source.stop() == 0


def test_a_second_ferryd_on_a_port_in_use_stops_with_the_reason(small, tmp_path):
    import subprocess
    r = subprocess.run([str(helpers.FERRYD), "--listen", small.info["listen"], "--data-dir",
                        str(tmp_path / "second"), "--provider", "tcp"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "cannot listen" in r.stderr, r.stderr
    assert call(small.url + "/v1/health")[0] == 200
