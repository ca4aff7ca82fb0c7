"""Graceful drain of ferryd (docs/http_api.md, "Drain"): SIGTERM or POST /v1/drain refuses new
pulls and uploads with 503 and Retry-After, lets the running pulls finish, then exits 0; the
grace period's end cancels what is left. A pull is held in flight by stopping its source
(SIGSTOP) after the request went, so the drain always meets it."""

from __future__ import annotations

import os
import signal
import urllib.error
import urllib.request

import pytest

import ferry
import helpers
from helpers import HeldPull, call, pattern, wait_until

MiB = 1 << 20


@pytest.fixture
def source(tmp_path):
    a = helpers.start_ferryd(tmp_path / "a")
    ferry.Client(a.url).put("w", pattern(MiB))
    yield a
    os.kill(a.proc.pid, signal.SIGCONT)
    assert a.stop() == 0


def test_sigterm_refuses_new_work_with_retry_after_and_the_running_pull_finishes(source, tmp_path):
    b = helpers.start_ferryd(tmp_path / "b")
    held = HeldPull(source, b, MiB)
    try:
        b.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: call(b.url + "/v1/health")[0] == 503, "draining health")
        status, headers, body = call(b.url + "/v1/health")
        assert body == {"status": "draining"}
        status, headers, body = call(b.url + "/v1/pulls", "POST",
                                     {"from": source.url, "object": "w", "into": {"device": "host"}})
        assert status == 503 and body["error"]["code"] == "UNAVAILABLE", body
        assert "draining" in body["error"]["message"]
        assert headers["Retry-After"] == "5"
        req = urllib.request.Request(b.url + "/v1/objects/x/data", method="PUT", data=b"abc",
                                     headers={"Content-Type": "application/octet-stream"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 503 and e.value.headers["Retry-After"] == "5"
        assert b.proc.poll() is None, "ferryd left before its pull finished"
    finally:
        held.release()
    status, _, stats = held.join()
    assert status == 200 and stats["bytes"] == MiB, stats
    assert b.proc.wait(30) == 0
    # The source served it to the end and still serves.
    assert ferry.Client(source.url).stat("w")["size"] == MiB


def test_post_drain_then_the_grace_period_cancels_what_is_left_and_exits_0(source, tmp_path):
    b = helpers.start_ferryd(tmp_path / "b", "--drain-grace-s", "1")
    held = HeldPull(source, b, MiB)
    try:
        status, _, body = call(b.url + "/v1/drain", "POST", {})
        assert status == 202 and body == {"status": "draining"}
        # The pull never ends while its source is stopped: the grace period cancels it.
        assert b.proc.wait(30) == 0
        status, _, answer = held.join()
        assert status == 503 and answer["error"]["code"] == "CANCELLED", answer
    finally:
        held.release()
    assert ferry.Client(source.url).stat("w")["size"] == MiB


def test_drain_needs_the_token(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    b = helpers.start_ferryd(tmp_path / "b", "--token-file", str(token))
    try:
        assert call(b.url + "/v1/drain", "POST", {})[0] == 401
        assert call(b.url + "/v1/health")[0] == 200
    finally:
        assert b.stop() == 0
