"""The status page (GET /) in headless Chromium (Debian's package) during a pull, with and
without a bearer token: the DOM shows the node, its rails and the running pull. A screenshot
of each goes to the build directory's test-artifacts/ (not committed)."""

from __future__ import annotations

import html
import re
import shutil
import subprocess

import pytest

import ferry
import helpers
from helpers import HeldPull, auth, call, pattern

MiB = 1 << 20
CHROMIUM = shutil.which("chromium") or "chromium"
TOOLS_ENV = helpers.TOOLS_ENV
ARTIFACTS = helpers.BUILD / "test-artifacts"


def render(url: str, screenshot: str) -> str:
    """The page's DOM once its scripts have run (virtual time: its fetches answered, two
    refreshes), and a screenshot of it."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    common = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
              "--virtual-time-budget=2500", "--window-size=1200,900"]
    dom = subprocess.run([*common, "--dump-dom", f"--screenshot={ARTIFACTS / screenshot}", url],
                         capture_output=True, env=TOOLS_ENV, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert (ARTIFACTS / screenshot).exists()
    return dom.stdout.decode()


def rows(dom: str, table: str) -> list[list[str]]:
    body = re.search(rf'<table id="{table}">.*?<tbody>(.*?)</tbody>', dom, re.S).group(1)
    return [[html.unescape(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", tr)]
            for tr in re.findall(r"<tr>(.*?)</tr>", body, re.S)]


@pytest.mark.parametrize("token", ["", "s3cret"])
def test_the_page_shows_the_node_its_rails_and_the_running_pull(tmp_path, token):
    extra = []
    if token:
        (tmp_path / "token").write_text(token + "\n")
        extra = ["--token-file", str(tmp_path / "token")]
    a = helpers.start_ferryd(tmp_path / "a", *extra)
    b = helpers.start_ferryd(tmp_path / "b", "--rails", "2", *extra)
    try:
        ferry.Client(a.url, token=token or None).put("w", pattern(MiB))
        _, _, node = call(b.url + "/v1/node", headers=auth(token))
        name = "with-token" if token else "open"
        if token:
            # Without the token the page says so and shows nothing of the node.
            dom = render(b.url + "/", f"status-{name}-refused.png")
            assert "this node wants its bearer token" in dom
            assert node["id"] not in dom
        # A held pull lasts a few seconds at most (the destination gives a silent source up),
        # and Chromium on a loaded machine may take longer than that to start: a rendering that
        # came too late is tried again, but only when the pull did end that way.
        for attempt in range(3):
            held = HeldPull(a, b, MiB, token, warm=f"warm{attempt}")
            try:
                dom = render(b.url + "/" + (f"#token={token}" if token else ""),
                             f"status-{name}.png")
            finally:
                held.release()
            status, _, stats = held.join()
            running = rows(dom, "running")
            if running or attempt == 2:
                break
            assert status == 503 and "the source stopped answering" in stats["error"]["message"], stats
        assert status == 200 and stats["bytes"] == MiB
        assert f'<span id="node-id" class="muted">{node["id"]}</span>' in dom
        rails = rows(dom, "rails")
        assert [r[1] for r in rails] == [r["domain"] for r in node["rails"]]
        assert all(r[2] == "tcp;ofi_rxm" for r in rails)
        assert running == [["destination", "w", a.url, "rdma", str(MiB), running[0][5]]]
        assert ["w", "1", str(MiB), "host", "yes", ""] not in rows(dom, "objects")  # b's: warm
        assert [f"warm{attempt}", "1", str(MiB), "host", "yes", ""] in rows(dom, "objects")
    finally:
        assert b.stop() == 0
        assert a.stop() == 0


def test_with_a_directory_the_page_shows_its_state_and_each_versions_holders(tmp_path):
    a = helpers.start_ferryd(tmp_path / "a", "--serve-directory")
    b = helpers.start_ferryd(tmp_path / "b", "--directory", a.url)
    try:
        ferry.Client(a.url).put("w", pattern(MiB))
        helpers.wait_until(lambda: any(o["name"] == "w" for n in call(b.url + "/v1/cluster")[2]["nodes"]
                                       for o in n["objects"]), "a holding w")
        assert call(b.url + "/v1/pulls", "POST", {"object": "w", "into": {"device": "host"}})[0] == 200
        helpers.wait_until(lambda: sum(o["name"] == "w" for n in call(a.url + "/v1/cluster")[2]["nodes"]
                                       for o in n["objects"]) == 2, "b holding w")
        dom = render(a.url + "/", "status-directory.png")
        assert f"directory {a.url} (joined)" in dom
        row = next(r for r in rows(dom, "objects") if r[0] == "w")
        assert row[:5] == ["w", "1", str(MiB), "host", "yes"]
        assert sorted(row[5].split(", ")) == sorted(u.split("//")[1] for u in (a.url, b.url)), row
    finally:
        assert b.stop() == 0
        assert a.stop() == 0
