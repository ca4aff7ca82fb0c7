"""REST for ordinary HTTP clients (docs/http_api.md, "Conditional requests"): HEAD, ETag,
Last-Modified, conditional GET, PUT and DELETE, If-Range, the CRC32C of uploads, with curl,
wget, aria2c and Python's urllib against a real ferryd."""

from __future__ import annotations

import http.server
import shutil
import subprocess
import threading
import urllib.error
import urllib.request

import pytest

import ferry
import helpers
from helpers import pattern

MiB = 1 << 20
TOOLS_ENV = helpers.TOOLS_ENV


@pytest.fixture
def ferryd(tmp_path):
    d = helpers.start_ferryd(tmp_path / "ferryd")
    yield d
    assert d.stop() == 0


def data_url(d, name="w", version=None):
    return f"{d.url}/v1/objects/{name}/data" + (f"?version={version}" if version else "")


def request(url, method="GET", headers=None, data=None):
    """(status, headers, body) of one request with urllib; errors are answers too."""
    req = urllib.request.Request(url, method=method, headers=headers or {}, data=data)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def put(d, name, data, headers=None, query=""):
    h = {"Content-Type": "application/octet-stream", **(headers or {})}
    return request(f"{d.url}/v1/objects/{name}/data{query}", "PUT", h, data)


def curl(*args):
    return subprocess.run(["curl", "-s", *args], capture_output=True, timeout=60, env=TOOLS_ENV)


def test_head_has_the_headers_of_get_and_no_body(ferryd):
    data = pattern(3 * MiB + 5).tobytes()
    assert put(ferryd, "w", data, {"Content-Type": "application/x-safetensors"})[0] == 201
    for url in (data_url(ferryd), f"{ferryd.url}/v1/objects/w"):
        s1, h_get, body = request(url)
        s2, h_head, empty = request(url, "HEAD")
        assert (s1, s2, empty) == (200, 200, b"")
        for k in ("ETag", "Last-Modified", "Content-Type", "Content-Length"):
            assert h_head[k] == h_get[k], (url, k)
    h = request(data_url(ferryd), "HEAD")[1]
    assert h["Content-Length"] == str(len(data)) and h["Accept-Ranges"] == "bytes"
    assert h["Content-Type"] == "application/x-safetensors"
    assert h["X-Ferry-CRC32C"] and h["ETag"].startswith('"') and h["ETag"].endswith(':w:1"')
    r = curl("-I", data_url(ferryd))
    assert r.stdout.startswith(b"HTTP/1.1 200") and b"ETag:" in r.stdout
    assert request(f"{ferryd.url}/v1/node", "HEAD")[0] == 200
    assert request(f"{ferryd.url}/v1/objects/absent", "HEAD")[0] == 404


def test_conditional_get(ferryd):
    put(ferryd, "w", b"one")
    _, h, _ = request(data_url(ferryd))
    etag, modified = h["ETag"], h["Last-Modified"]
    assert request(data_url(ferryd), headers={"If-None-Match": etag})[0] == 304
    assert request(data_url(ferryd), headers={"If-None-Match": f'"x", W/{etag}'})[0] == 304
    assert request(data_url(ferryd), headers={"If-None-Match": '"x"'})[0] == 200
    assert request(data_url(ferryd), headers={"If-Modified-Since": modified})[0] == 304
    assert request(data_url(ferryd),
                   headers={"If-Modified-Since": "Thu, 01 Jan 1970 00:00:00 GMT"})[0] == 200
    assert request(data_url(ferryd), headers={"If-Match": etag})[2] == b"one"
    status, _, body = request(data_url(ferryd), headers={"If-Match": '"stale"'})
    assert status == 412 and b"FAILED_PRECONDITION" in body
    # A new version: the old ETag no longer matches, the old version keeps its own.
    put(ferryd, "w", b"two", query="?replace=true")
    assert request(data_url(ferryd), headers={"If-None-Match": etag})[0] == 200
    assert request(data_url(ferryd, version=1), headers={"If-None-Match": etag})[0] == 304
    assert request(data_url(ferryd), headers={"If-Match": etag})[0] == 412


def test_conditional_put_and_delete_change_nothing_when_stale(ferryd):
    assert put(ferryd, "w", b"v1", {"If-None-Match": "*"})[0] == 201
    assert put(ferryd, "w", b"v2", {"If-None-Match": "*"})[0] == 412
    etag1 = request(data_url(ferryd), "HEAD")[1]["ETag"]
    assert put(ferryd, "w", b"v2", {"If-Match": etag1})[0] == 201  # a replace, by its ETag
    etag2 = request(data_url(ferryd), "HEAD")[1]["ETag"]
    assert etag2 != etag1
    # Stale: refused, and the object is as it was.
    assert put(ferryd, "w", b"v3", {"If-Match": etag1})[0] == 412
    layout = b'{"extents":[[1,0,1]]}'
    assert request(f"{ferryd.url}/v1/objects/w", "PUT",
                   {"If-Match": etag1, "Content-Type": "application/json"}, layout)[0] == 412
    assert request(f"{ferryd.url}/v1/objects/w", "DELETE", {"If-Match": etag1})[0] == 412
    assert request(data_url(ferryd))[2] == b"v2"
    with ferry.Client(ferryd.url) as c:
        assert c.stat("w")["version"] == 2
    assert request(f"{ferryd.url}/v1/objects/w", "DELETE", {"If-Match": etag2})[0] == 200
    assert request(data_url(ferryd))[0] == 404
    assert request(f"{ferryd.url}/v1/objects/w", "DELETE", {"If-Match": "*"})[0] == 412


def test_if_range_resumes_only_the_same_version(ferryd, tmp_path):
    v1, v2 = pattern(MiB, seed=1).tobytes(), pattern(MiB, seed=2).tobytes()
    put(ferryd, "w", v1)
    etag1 = request(data_url(ferryd), "HEAD")[1]["ETag"]
    status, h, body = request(data_url(ferryd), headers={"Range": "bytes=1000-", "If-Range": etag1})
    assert (status, body) == (206, v1[1000:])
    put(ferryd, "w", v2, query="?replace=true")
    status, h, body = request(data_url(ferryd), headers={"Range": "bytes=1000-", "If-Range": etag1})
    assert (status, body) == (200, v2)  # another version: the whole of it
    # curl resuming a partial file with the ETag it saw.
    part = tmp_path / "part"
    part.write_bytes(v2[:4096])
    etag2 = request(data_url(ferryd), "HEAD")[1]["ETag"]
    r = curl("-C", "-", "-H", f"If-Range: {etag2}", "-o", str(part), data_url(ferryd))
    assert r.returncode == 0 and part.read_bytes() == v2


@pytest.mark.skipif(not shutil.which("wget") or not shutil.which("aria2c"),
                    reason="wget and aria2c come with deploy/install-deps.sh")
def test_wget_resume_and_aria2c_connections_get_identical_bytes(ferryd, tmp_path):
    data = pattern(8 * MiB, seed=4).tobytes()
    put(ferryd, "big", data)
    part = tmp_path / "big.wget"
    part.write_bytes(data[:1000])
    r = subprocess.run(["wget", "-q", "-c", "-O", str(part), data_url(ferryd, "big")],
                       capture_output=True, timeout=120, env=TOOLS_ENV)
    assert r.returncode == 0, r.stderr
    assert part.read_bytes() == data
    r = subprocess.run(["aria2c", "-q", "-x", "4", "-s", "4", "-k", "1M", "-d", str(tmp_path),
                        "-o", "big.aria2", data_url(ferryd, "big")], capture_output=True,
                       timeout=120, env=TOOLS_ENV)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "big.aria2").read_bytes() == data


class CorruptingProxy(http.server.BaseHTTPRequestHandler):
    """Forwards GETs to the node, flipping one byte of every body it passes on."""

    upstream = ""

    def do_GET(self):  # noqa: N802 - http.server's name
        status, headers, body = request(self.upstream + self.path)
        body = bytearray(body)
        if body:
            body[len(body) // 2] ^= 0x40
        self.send_response(status)
        for k, v in headers.items():
            if k.lower() not in ("transfer-encoding", "connection", "keep-alive"):
                self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_corrupted_download_is_detected_by_its_crc32c(ferryd, tmp_path):
    data = pattern(MiB, seed=6).tobytes()
    put(ferryd, "w", data)
    CorruptingProxy.upstream = ferryd.url
    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), CorruptingProxy)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    via = f"http://127.0.0.1:{proxy.server_address[1]}"
    try:
        out = tmp_path / "got"
        r = subprocess.run([str(helpers.FERRY_CLI), "--node", via, "get", "w", "-o", str(out)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "CRC32C" in r.stderr, r.stderr
        with ferry.Client(via) as c, pytest.raises(ferry.DataLoss, match="CRC32C"):
            c.get("w")
        with ferry.Client(ferryd.url) as c:  # straight from the node: intact and checked
            assert c.get("w") == data
            assert c.stat("w")["crc32c"] == request(data_url(ferryd), "HEAD")[1]["X-Ferry-CRC32C"]
    finally:
        proxy.shutdown()


def test_content_type_at_upload_and_publish_is_checked_and_given_back(ferryd):
    assert put(ferryd, "t", b"x", query="?content_type=text/csv")[0] == 201
    assert request(data_url(ferryd, "t"))[1]["Content-Type"] == "text/csv"
    assert put(ferryd, "u", b"x", query="?content_type=nonsense")[0] == 400
    assert put(ferryd, "u", b"x", query="?content_type=" + "a/" + "b" * 200)[0] == 400
    assert request(data_url(ferryd, "u"))[0] == 404
    assert request(data_url(ferryd, "t"))[1].get("X-Ferry-CRC32C") is not None


def test_meta_labels_come_as_headers(ferryd):
    with ferry.Client(ferryd.url) as c:
        c.put("m", b"x", meta={"dtype": "bf16", "layers": 32, "ok": True, "tensors": [1],
                               "bad key": "x", "long": "y" * 300})
    h = request(data_url(ferryd, "m"), "HEAD")[1]
    assert (h["X-Ferry-Meta-dtype"], h["X-Ferry-Meta-layers"], h["X-Ferry-Meta-ok"]) == \
        ("bf16", "32", "true")
    assert h.get("X-Ferry-Meta-tensors") is None and h.get("X-Ferry-Meta-long") is None


def test_too_many_or_overlapping_ranges_get_the_whole_object_once(ferryd):
    data = pattern(16384).tobytes()
    assert put(ferryd, "r", data)[0] == 201
    # 500 ranges of the whole object would be 8 MB from 16 KiB: the object, once, instead.
    status, headers, body = request(data_url(ferryd, "r"),
                                    headers={"Range": "bytes=" + ",".join(["0-16383"] * 500)})
    assert status == 200 and body == data and "Content-Range" not in headers
    overlapping = ",".join(["0-9999", "5000-16383"])
    status, _, body = request(data_url(ferryd, "r"), headers={"Range": f"bytes={overlapping}"})
    assert status == 200 and body == data
    # Up to 16 disjoint ranges stay a multipart 206.
    few = ",".join(f"{i * 1000}-{i * 1000 + 9}" for i in range(16))
    status, headers, body = request(data_url(ferryd, "r"), headers={"Range": f"bytes={few}"})
    assert status == 206 and headers["Content-Type"].startswith("multipart/byteranges")
    assert 160 < len(body) < 16384


def test_an_empty_suffix_range_is_416_with_one_content_range(ferryd):
    assert put(ferryd, "r", pattern(16384).tobytes())[0] == 201
    status, headers, _ = request(data_url(ferryd, "r"), headers={"Range": "bytes=-0"})
    assert status == 416
    assert headers.get_all("Content-Range") == ["bytes */16384"]


def test_differing_content_lengths_are_refused_and_the_connection_closed(ferryd):
    import socket
    host, port = ferryd.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"PUT /v1/objects/x/data HTTP/1.1\r\nHost: a\r\n"
                  b"Content-Type: application/octet-stream\r\n"
                  b"Content-Length: 3\r\nContent-Length: 5\r\n\r\nabcde")
        answer = b""
        while chunk := s.recv(65536):  # ends when the node closes the connection
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400 "), answer
    assert b"Content-Length headers that differ" in answer
    assert request(f"{ferryd.url}/v1/objects/x")[0] == 404
