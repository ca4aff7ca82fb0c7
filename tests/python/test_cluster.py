"""The cluster (docs/cluster.md): nodes join a directory, on etcd (started here from Debian's
etcd-server on loopback in a temporary directory) or a ferryd with --serve-directory, leave it
on SIGTERM, vanish from it within their lease when killed, and pull objects by name from any
holder. Each test runs once per directory; every node is a real ferryd process."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

import ferry
import helpers
from helpers import FERRY_CLI, FERRYD, Ready, call, free_port, pattern, stop_process, wait_until

MiB = 1 << 20
ETCD = shutil.which("etcd") or "/usr/bin/etcd"


class Directory:
    """A directory the test runs: start() brings it up empty, kill() takes it down at once."""

    def __init__(self, tmp: Path):
        self.tmp, self.port = tmp, free_port()
        self.proc = None
        self.start()

    def restart(self):
        self.kill()
        self.start()

    def kill(self):
        self.proc.kill()
        self.proc.wait()

    def close(self):
        self.kill()


class EtcdDirectory(Directory):
    """One etcd member on loopback."""

    def start(self):
        self.url = f"etcd://127.0.0.1:{self.port}"
        self.peer = getattr(self, "peer", None) or free_port()
        data = self.tmp / "etcd"
        shutil.rmtree(data, ignore_errors=True)
        client, peer = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.peer}"
        self.proc = subprocess.Popen(
            [ETCD, "--name", "t", "--data-dir", str(data), "--listen-client-urls", client,
             "--advertise-client-urls", client, "--listen-peer-urls", peer,
             "--initial-advertise-peer-urls", peer, "--initial-cluster", f"t={peer}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self.answers, "etcd answering", 30)

    def answers(self) -> bool:
        try:
            return call(f"http://127.0.0.1:{self.port}/v3/kv/range", "POST", {"key": "eA=="})[0] == 200
        except OSError:
            return False


class EmbeddedDirectory(Directory):
    """A ferryd with --serve-directory on a fixed port."""

    def start(self):
        self.url = f"http://127.0.0.1:{self.port}"
        data = self.tmp / "directory-node"
        shutil.rmtree(data, ignore_errors=True)
        node = Ready([str(FERRYD), "--listen", f"127.0.0.1:{self.port}", "--data-dir",
                      str(data), "--provider", "tcp", "--serve-directory"])
        self.proc = node.proc


@pytest.fixture(params=["embedded", "etcd"])
def directory(request, tmp_path):
    d = (EmbeddedDirectory if request.param == "embedded" else EtcdDirectory)(tmp_path)
    yield d
    d.close()


class Nodes:
    """The test's ferryd processes, stopped at the end (SIGCONT first: a test may stop one)."""

    def __init__(self, tmp: Path, directory):
        self.tmp, self.directory, self.all = tmp, directory, []

    def start(self, name: str, ttl: int = 30, *extra: str) -> Ready:
        n = helpers.start_ferryd(self.tmp / name, "--directory", self.directory.url,
                                 "--directory-ttl-s", str(ttl), "--label", f"name={name}", *extra)
        n.id = n.info["node"]
        self.all.append(n)
        return n

    def close(self):
        for n in self.all:
            if n.proc.poll() is None:
                os.kill(n.proc.pid, signal.SIGCONT)
            n.stop()


@pytest.fixture
def nodes(tmp_path, directory):
    n = Nodes(tmp_path, directory)
    yield n
    n.close()


def members(node) -> dict:
    """node id -> record, as GET /v1/cluster on `node` lists them."""
    status, _, body = call(node.url + "/v1/cluster")
    assert status == 200, body
    return {r["id"]: r for r in body["nodes"]}


def holds(node, of, name: str) -> int | None:
    """The version of `name` that node `of` holds, as the directory says (None: none)."""
    record = members(node).get(of.id)
    versions = [o["version"] for o in (record or {}).get("objects", []) if o["name"] == name]
    return max(versions) if versions else None


def pull(node, body: dict, timeout: float = 60):
    return call(node.url + "/v1/pulls", "POST", {"into": {"device": "host"}, **body})


def data(node, name: str) -> bytes:
    status, _, raw = call(node.url + f"/v1/objects/{name}/data")
    assert status == 200, raw
    return raw


def test_nodes_join_with_their_record_and_sigterm_withdraws_it_at_once(nodes):
    a = nodes.start("a")
    b = nodes.start("b")
    wait_until(lambda: {a.id, b.id} <= members(a).keys(), "both nodes in the directory")
    record = members(a)[b.id]
    assert record["url"] == b.url and record["state"] == "ready"
    assert record["labels"] == {"name": "b"}
    assert record["host"] and record["rails"], record
    status, _, info = call(b.url + "/v1/node")
    assert info["directory"] == {"url": nodes.directory.url, "state": "joined"}
    b.proc.send_signal(signal.SIGTERM)
    assert b.proc.wait(30) == 0
    # Revoked on the way out: gone now, not after the 30 s lease.
    assert b.id not in members(a)
    assert a.id in members(a)


def test_a_killed_node_vanishes_within_its_lease(nodes):
    a = nodes.start("a")
    b = nodes.start("b", 2)
    wait_until(lambda: b.id in members(a), "b in the directory")
    b.proc.kill()
    b.proc.wait()
    killed = time.monotonic()
    wait_until(lambda: b.id not in members(a), "b gone", 10)
    # The lease is 2 s; the directory ends leases on a clock of its own (etcd checks every
    # 500 ms, ferryd every 100 ms).
    assert time.monotonic() - killed < 2 + 1.5
    assert a.id in members(a)


def test_a_pull_by_name_takes_a_holders_version_and_the_puller_becomes_a_holder(nodes):
    a = nodes.start("a")
    b = nodes.start("b")
    c = nodes.start("c")
    blob = pattern(2 * MiB).tobytes()
    ferry.Client(a.url).put("w", blob)
    ferry.Client(a.url).put("w", blob[::-1], replace=True)  # version 2
    wait_until(lambda: holds(a, a, "w") == 2, "a holding w 2")
    status, _, stats = pull(b, {"object": "w"})
    assert status == 200, stats
    assert stats["source"] == a.url and stats["tried"] == [] and stats["version"] == 2, stats
    assert data(b, "w") == blob[::-1]
    # b holds version 2 under a's number, and says so.
    assert ferry.Client(b.url).stat("w")["version"] == 2
    wait_until(lambda: holds(c, b, "w") == 2, "b holding w 2")
    # Told not to, a puller is no holder; a version named is that version.
    status, _, stats = pull(c, {"object": "w", "version": 1, "announce": False})
    assert status == 200 and stats["source"] == a.url and stats["version"] == 1, stats
    assert data(c, "w") == blob
    assert holds(a, c, "w") is None
    # The CLI: a pull by name says where from; `ferry cluster` lists nodes and holdings.
    r = subprocess.run([str(FERRY_CLI), "--node", c.url, "pull", "w", "--as", "w-cli"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"from {a.url}" in r.stdout or f"from {b.url}" in r.stdout, r.stdout
    r = subprocess.run([str(FERRY_CLI), "--node", c.url, "cluster"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith(b.id))
    assert b.url in line and "ready" in line, r.stdout
    # Nobody holds it: 404, and nothing was made.
    status, _, body = pull(c, {"object": "nothing"})
    assert status == 404 and body["error"]["code"] == "NOT_FOUND", body
    assert "no other node" in body["error"]["message"]
    status, _, body = pull(c, {"object": "w", "version": 9})
    assert status == 404, body
    # Bad input is refused before the directory is asked.
    status, _, body = pull(c, {"object": "bad@name"})
    assert status == 400 and body["error"]["code"] == "INVALID_ARGUMENT", body


def test_a_version_the_catalog_drops_leaves_the_directory_announced_or_not(nodes):
    a = nodes.start("a")
    b = nodes.start("b", 30, "--keep-versions", "1")
    ferry.Client(a.url).put("w", pattern(MiB).tobytes())
    wait_until(lambda: holds(b, a, "w") == 1, "a holding w")
    assert pull(b, {"object": "w"})[0] == 200
    wait_until(lambda: holds(a, b, "w") == 1, "b holding w 1")
    # Pulled again with replace: b has version 1 already, so the copy is b's own version 2,
    # not announced, and version 1 goes (--keep-versions 1): b holds nothing others name.
    status, _, stats = pull(b, {"from": a.url, "object": "w", "replace": True})
    assert status == 200, stats
    assert ferry.Client(b.url).stat("w")["version"] == 2
    wait_until(lambda: holds(a, b, "w") is None, "b's version 1 gone from the directory")


def test_the_chosen_holder_killed_mid_pull_and_the_pull_completes_from_another(nodes):
    a = nodes.start("a")
    b = nodes.start("b")
    c = nodes.start("c")
    blob = pattern(4 * MiB).tobytes()
    ferry.Client(a.url).put("w", blob)
    wait_until(lambda: holds(c, a, "w") == 1, "a holding w")
    # Through the Python client: no source named.
    got = ferry.Client(b.url).pull("w")
    assert (got.bytes, got.source, got.tried) == (4 * MiB, a.url, []), got
    wait_until(lambda: holds(c, b, "w") == 1 and holds(c, a, "w") == 1, "two holders")
    # c knows both (sessions up), then both holders stop: c's pull by name waits on the one it
    # chose, which is killed; the other goes on.
    for h in (a, b):
        status, _, _ = pull(c, {"from": h.url, "object": "w", "as": "warm", "replace": True})
        assert status == 200
    # Into a region: the pull asks the source nothing before it goes (a new buffer would ask
    # its size), so it is running, with its source chosen, while that source is stopped.
    status, _, region = call(c.url + "/v1/regions", "POST", {"size": 4 * MiB})
    assert status == 201, region
    into = {"extents": [{"region": region["id"], "offset": 0, "length": 4 * MiB}]}
    for h in (a, b):
        stop_process(h.proc.pid)
    result = {}
    t = threading.Thread(target=lambda: result.update(r=pull(c, {"object": "w", "into": into})))
    t.start()

    def chosen():
        running = call(c.url + "/v1/pulls")[2]["running"]
        return running[0]["peer"] if running else None

    wait_until(lambda: chosen() is not None, "c's pull running")
    dead = a if chosen() == a.url else b
    other = b if dead is a else a
    dead.proc.kill()
    dead.proc.wait()
    os.kill(other.proc.pid, signal.SIGCONT)
    t.join(60)
    assert not t.is_alive()
    status, _, stats = result["r"]
    assert status == 200, stats
    assert stats["source"] == other.url, stats
    assert len(stats["tried"]) == 1 and dead.url in stats["tried"][0], stats
    # The region's bytes, published under a name of their own and read back.
    status, _, body = call(c.url + "/v1/objects/got", "PUT", into)
    assert status == 201, body
    assert data(c, "got") == blob
    # The dead holder's records stay until its lease ends: the Python client's pulls by name
    # go past it when it comes first (the order among holders is random: one in two).
    with ferry.Client(c.url) as client:
        for _ in range(30):
            got = client.pull("w", as_="by-name", replace=True)
            assert (got.bytes, got.source) == (4 * MiB, other.url), got
            if got.tried:
                break
    assert len(got.tried) == 1 and got.tried[0].startswith(f"{dead.id} at {dead.url}: "), got


def test_with_the_directory_down_named_pulls_work_and_pulls_by_name_fail_fast_then_nodes_come_back(
        nodes, directory):
    a = nodes.start("a", 3)
    b = nodes.start("b", 3)
    ferry.Client(a.url).put("w", pattern(MiB).tobytes())
    wait_until(lambda: holds(b, a, "w") == 1, "a holding w")
    directory.kill()
    started = time.monotonic()
    status, _, body = pull(b, {"object": "w"})
    assert status == 503 and body["error"]["code"] == "UNAVAILABLE", body
    assert "directory" in body["error"]["message"] and "unreachable" in body["error"]["message"]
    assert time.monotonic() - started < 10
    status, _, body = call(b.url + "/v1/cluster")
    assert status == 503, body
    status, _, stats = pull(b, {"from": a.url, "object": "w"})
    assert status == 200 and stats["bytes"] == MiB, stats
    wait_until(lambda: call(b.url + "/v1/node")[2]["directory"]["state"] != "joined",
               "b seeing the directory gone")
    # Back, empty (etcd's data and ferryd's store wiped): every node puts its records again.
    directory.restart()
    wait_until(lambda: {a.id, b.id} <= members(b).keys() and holds(b, a, "w") == 1
               and holds(a, b, "w") == 1, "records put again", 30)
    assert call(b.url + "/v1/node")[2]["directory"]["state"] == "joined"
    status, _, stats = pull(nodes.start("c"), {"object": "w"})
    assert status == 200 and stats["source"] in (a.url, b.url), stats


def test_without_a_directory_a_pull_names_its_source(tmp_path):
    a = helpers.start_ferryd(tmp_path / "a")
    try:
        status, _, body = pull(a, {"object": "w"})
        assert status == 400 and body["error"]["code"] == "INVALID_ARGUMENT", body
        assert "--directory" in body["error"]["message"]
        status, _, body = call(a.url + "/v1/cluster")
        assert status == 400 and body["error"]["code"] == "FAILED_PRECONDITION", body
        assert "directory" not in call(a.url + "/v1/node")[2]
    finally:
        assert a.stop() == 0


@pytest.mark.parametrize("flags,message", [
    (["--directory", "ftp://h:1"], "etcd://"),
    (["--directory", "etcd://127.0.0.1:1", "--label", "novalue"], "KEY=VALUE"),
    (["--directory", "etcd://127.0.0.1:1", "--directory-ttl-s", "0"], "directory-ttl-s"),
])
def test_bad_directory_flags_stop_ferryd_with_the_reason(tmp_path, flags, message):
    r = subprocess.run([str(FERRYD), "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "n"),
                        "--provider", "tcp", *flags], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and message in r.stderr, r.stderr


def test_a_node_on_every_address_must_say_how_others_reach_it(tmp_path):
    r = subprocess.run([str(FERRYD), "--listen", "0.0.0.0:0", "--insecure", "--data-dir",
                        str(tmp_path / "n"), "--provider", "tcp", "--directory",
                        "etcd://127.0.0.1:1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--advertise-url" in r.stderr, r.stderr
