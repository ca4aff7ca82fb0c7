"""Limits that refuse cleanly (issue 28): the host memory budget (--memory-limit-mb), and
HTTP clients that are slow on purpose (slow heads, bodies and readers), which the node closes
while it goes on serving everyone else."""

from __future__ import annotations

import os
import re
import select
import socket
import subprocess
import threading
import time

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
    r = subprocess.run([str(helpers.FERRYD), "--listen", small.info["listen"], "--data-dir",
                        str(tmp_path / "second"), "--provider", "tcp"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "cannot listen" in r.stderr, r.stderr
    assert call(small.url + "/v1/health")[0] == 200


# Slow clients. The node closes a request whose head is not whole 2 s after its first byte;
# a request slow for 1 s takes one of 2 slots, and one more slow request is closed at once.
HEAD_TIMEOUT_S = 2.0


@pytest.fixture
def guarded(tmp_path):
    d = helpers.start_ferryd(tmp_path / "guarded", "--http-head-timeout-ms",
                             str(int(HEAD_TIMEOUT_S * 1000)), "--http-max-slow", "2",
                             "--http-min-rate-kib", "65536")
    d.host, d.port = d.info["listen"].rsplit(":", 1)
    yield d
    assert d.stop() == 0


def connect(node) -> socket.socket:
    return socket.create_connection((node.host, int(node.port)), timeout=30)


def drip(sock: socket.socket, data: bytes, every: float, seconds: float) -> bytes:
    """Sends `data` a byte or a chunk at a time (len(data) // 400 + 1 bytes each `every`
    seconds) until the peer answers or closes, for at most `seconds`; returns the answer."""
    step = len(data) // 400 + 1
    end = time.monotonic() + seconds
    sent = 0
    while sent < len(data) and time.monotonic() < end:
        try:
            sock.sendall(data[sent:sent + step])
        except OSError:
            break
        sent += step
        if select.select([sock], [], [], every)[0]:
            break
    return read_to_end(sock)


def read_to_end(sock: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            chunk = sock.recv(1 << 20)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    return out


def slow_closed(node) -> dict[str, float]:
    text = call(node.url + "/metrics")[2].decode()
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'ferry_http_slow_closed_total\{why="(\w+)"\} (\S+)', text)}


def test_slow_heads_are_closed_with_408_and_every_route_stays_served(guarded):
    # 12 connections dripping their heads a byte every 50 ms: more than httplib's pool of 8
    # threads, which they used to hold until the head came (20 s here).
    head = b"GET /v1/health HTTP/1.1\r\nHost: a\r\n" + b"X-Slow: " + b"s" * 400 + b"\r\n\r\n"
    socks = [connect(guarded) for _ in range(12)]
    for s in socks:
        s.sendall(head[:10])
    answers = [b""] * len(socks)

    def one(i):
        answers[i] = drip(socks[i], head[10:], 0.05, 20)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(socks))]
    for t in threads:
        t.start()
    # While they drip, other requests are served.
    status, _, body = call(guarded.url + "/v1/health")
    assert (status, body) == (200, {"status": "ok"})
    for t in threads:
        t.join()
    for a in answers:
        assert a.startswith(b"HTTP/1.1 408 "), a
        assert b'"code":"DEADLINE_EXCEEDED"' in a
    late = [a for a in answers if b"did not arrive in time" in a]
    refused = [a for a in answers if b"too many slow requests" in a]
    assert (len(late), len(refused)) == (2, 10)
    assert slow_closed(guarded) == {"head": 2, "slots": 10}
    assert call(guarded.url + "/v1/health")[0] == 200


def test_a_body_that_falls_behind_the_minimum_rate_is_refused_and_changes_nothing(guarded):
    size = 4 << 20
    s = connect(guarded)
    s.sendall(b"PUT /v1/objects/slow/data HTTP/1.1\r\nHost: a\r\nContent-Length: "
              + str(size).encode() + b"\r\n\r\n")
    answer = drip(s, bytes(size), 0.05, 20)  # 10 KiB every 50 ms: far below 64 MiB/s
    assert answer.startswith(b"HTTP/1.1 408 ") and b"fell behind the minimum rate" in answer
    assert slow_closed(guarded) == {"rate": 1}
    assert call(guarded.url + "/v1/objects/slow")[0] == 404


def test_a_reader_that_falls_behind_is_cut_off(guarded):
    size = 64 << 20
    ferry.Client(guarded.url).put("big", pattern(size))
    s = connect(guarded)
    s.sendall(b"GET /v1/objects/big/data HTTP/1.1\r\nHost: a\r\n\r\n")
    # Nothing read until the node has closed the connection: what fit in the sockets' buffers.
    helpers.wait_until(lambda: slow_closed(guarded).get("rate") == 1, "slow reader closed")
    got = read_to_end(s)
    assert got.startswith(b"HTTP/1.1 200 ") and len(got) < size
    assert call(guarded.url + "/v1/health")[0] == 200


def test_a_handler_that_waits_past_every_deadline_still_answers(guarded, tmp_path):
    # The request's small body comes with its head; the pull is then held (its source stopped)
    # for longer than the head timeout, which the answer must not be judged by.
    source = helpers.start_ferryd(tmp_path / "source")
    try:
        ferry.Client(source.url).put("w", pattern(MiB))
        held = helpers.HeldPull(source, guarded, MiB)
        time.sleep(HEAD_TIMEOUT_S * 1.5)  # the time that has to pass, not an interleaving
        held.release()
        status, _, body = held.join()
        assert status == 200 and body["bytes"] == MiB, body
        assert slow_closed(guarded) == {}
    finally:
        assert source.stop() == 0


def test_pipelined_requests_are_all_answered_in_order(guarded):
    s = connect(guarded)
    one = b"GET /v1/health HTTP/1.1\r\nHost: a\r\n\r\n"
    last = b"GET /v1/objects/none HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
    s.sendall(one * 3 + last)
    got = read_to_end(s)
    statuses = re.findall(rb"HTTP/1.1 (\d+) ", got)
    assert statuses == [b"200", b"200", b"200", b"404"], got


# A full data disk: a tmpfs of 64 MiB mounted for the node's data dir (root only), filled with
# a file until less than --min-free-disk-mb is left.
@pytest.fixture
def small_disk(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small disk needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], check=True)
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


def fill(disk, leave_mib: int):
    st = os.statvfs(disk)
    size = st.f_bavail * st.f_frsize - (leave_mib << 20)
    with open(disk / "filler", "wb") as f:
        f.truncate(0)
        f.write(bytes(size))  # tmpfs: written pages are the space used


def test_a_full_data_disk_refuses_writes_with_507_serves_reads_and_recovers(small_disk, tmp_path):
    data = small_disk / "node"
    node = helpers.start_ferryd(data, "--min-free-disk-mb", "16")
    client = ferry.Client(node.url)
    try:
        client.put("before", pattern(1 * MiB))
        regions = call(node.url + "/v1/regions")[2]["regions"]
        fill(small_disk, 8)
        # Writes are refused and change nothing; the node says why.
        status, _, body = call(node.url + "/v1/regions", "POST", {"size": MiB})
        assert status == 507 and body["error"]["code"] == "RESOURCE_EXHAUSTED", body
        assert "MiB free, below the 16 MiB" in body["error"]["message"]
        assert call(node.url + "/v1/regions")[2]["regions"] == regions
        with pytest.raises(ferry.ResourceExhausted):
            client.put("during", pattern(MiB))
        assert call(node.url + "/v1/objects/during")[0] == 404
        # Reads and pulls from it go on.
        assert bytes(client.get("before")) == pattern(MiB).tobytes()
        other = helpers.start_ferryd(tmp_path / "other")
        try:
            stats = ferry.Client(other.url).pull("before", node.url)
            assert stats.bytes == MiB
        finally:
            assert other.stop() == 0
        assert call(node.url + "/v1/health")[0] == 200
        # Room again: writes go on, without a restart.
        (small_disk / "filler").unlink()
        client.put("after", pattern(MiB, seed=2))
    finally:
        assert node.stop() == 0
    # Nothing acknowledged was lost.
    node = helpers.start_ferryd(data, "--min-free-disk-mb", "16")
    try:
        names = {o["name"] for o in call(node.url + "/v1/objects")[2]["objects"]}
        assert names == {"before", "after"}
    finally:
        assert node.stop() == 0
    # Without the room, ferryd does not open the catalog: it says why and exits 1.
    fill(small_disk, 8)
    r = subprocess.run([str(helpers.FERRYD), "--listen", "127.0.0.1:0", "--data-dir", str(data),
                        "--provider", "tcp", "--min-free-disk-mb", "16"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "MiB ferryd keeps free" in r.stderr, r.stderr


def test_the_directory_a_node_serves_keeps_the_same_margin_of_free_disk(small_disk):
    node = helpers.start_ferryd(small_disk / "node", "--serve-directory", "--min-free-disk-mb", "16")
    kv = node.url + "/v3/kv/"
    key, value = "a2V5", "dmFsdWU="  # base64, as etcd's gateway takes them
    try:
        assert call(kv + "put", "POST", {"key": key, "value": value})[0] == 200
        fill(small_disk, 8)
        status, _, body = call(kv + "put", "POST", {"key": key, "value": "b3RoZXI="})
        assert status == 507 and "MiB free, below the 16 MiB" in body["message"], body
        assert call(node.url + "/v3/lease/grant", "POST", {"TTL": 10})[0] == 507
        assert call(kv + "deleterange", "POST", {"key": key})[0] == 507
        # Reads go on, and nothing changed.
        status, _, body = call(kv + "range", "POST", {"key": key})
        assert status == 200 and body["kvs"][0]["value"] == value, body
        (small_disk / "filler").unlink()
        assert call(kv + "put", "POST", {"key": key, "value": "b3RoZXI="})[0] == 200
    finally:
        assert node.stop() == 0
