"""HTTPS on ferryd's port (--tls-cert, --tls-key), as curl sees it: a certificate made for the
test, uploads and reads over TLS, clients that do not trust it refused, plain HTTP told to use
https, a silent connection closed at the head deadline, bad key material refused at start."""
from __future__ import annotations

import socket
import subprocess

import pytest

import ferry
import helpers


@pytest.fixture
def cert(tmp_path):
    """(certificate, key) of a self-signed certificate for 127.0.0.1."""
    c, k = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(k), "-out", str(c),
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-days", "2"], check=True, capture_output=True)
    return c, k


def curl(*args):
    return subprocess.run(["curl", "-sS", "--max-time", "30", *args], capture_output=True,
                          env=helpers.TOOLS_ENV)


def test_uploads_and_reads_go_over_https_and_untrusting_or_plain_clients_are_refused(
        tmp_path, cert):
    c, k = cert
    node = helpers.start_ferryd(tmp_path / "n", "--tls-cert", str(c), "--tls-key", str(k),
                                "--http-head-timeout-ms", "1000")
    try:
        assert node.info["url"].startswith("https://127.0.0.1:")
        url = node.info["url"]
        r = curl("--cacert", str(c), url + "/v1/health")
        assert r.returncode == 0 and b'"ok"' in r.stdout, r.stderr
        blob = tmp_path / "blob"
        blob.write_bytes(bytes(range(256)) * 20000)  # 5 MB
        r = curl("--cacert", str(c), "-X", "PUT", "--data-binary", f"@{blob}",
                 url + "/v1/objects/b/data")
        assert r.returncode == 0 and b'"version":1' in r.stdout, r.stdout + r.stderr
        back = tmp_path / "back"
        r = curl("--cacert", str(c), "-o", str(back), url + "/v1/objects/b/data")
        assert r.returncode == 0 and back.read_bytes() == blob.read_bytes()
        r = curl("--cacert", str(c), "-H", "Range: bytes=10-19", url + "/v1/objects/b/data")
        assert r.stdout == blob.read_bytes()[10:20]
        # A client that does not trust the certificate (curl: 60), plain HTTP (told in plain
        # HTTP to use https), and a connection that never says hello: closed at the head
        # deadline.
        assert curl(url + "/v1/health").returncode == 60
        r = curl("-w", "%{http_code}", url.replace("https", "http") + "/v1/health")
        assert r.returncode == 0, r.stderr
        assert r.stdout.endswith(b"}400"), r.stdout
        assert b'"INVALID_ARGUMENT"' in r.stdout and b"use https://" in r.stdout, r.stdout
        host, port = url[len("https://"):].split(":")
        with socket.create_connection((host, int(port))) as s:
            s.settimeout(20)
            assert s.recv(1) == b""
        assert curl("--cacert", str(c), url + "/v1/health").returncode == 0
    finally:
        assert node.stop() == 0


def test_key_material_that_cannot_be_used_stops_ferryd_at_start(tmp_path, cert):
    c, k = cert
    other = tmp_path / "other.pem"
    subprocess.run(["openssl", "genpkey", "-algorithm", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-out", str(other)], check=True,
                   capture_output=True)

    def start(*tls):
        return subprocess.run([str(helpers.FERRYD), "--listen", "127.0.0.1:0", "--data-dir",
                               str(tmp_path / "n"), "--provider", "tcp", *tls],
                              capture_output=True, text=True, timeout=60)

    r = start("--tls-cert", str(c), "--tls-key", str(other))
    assert r.returncode == 2 and "key values mismatch" in r.stderr, r.stderr
    r = start("--tls-cert", str(tmp_path / "missing.pem"), "--tls-key", str(k))
    assert r.returncode == 2 and "cannot use the certificate" in r.stderr, r.stderr
    r = start("--tls-cert", str(c))
    assert r.returncode != 0 and "--tls-key" in r.stderr, r.stderr


def test_nodes_and_the_python_client_pull_and_read_over_https(tmp_path, cert, monkeypatch):
    # The certificate is its own CA here: OpenSSL's SSL_CERT_FILE names it, for the test's
    # client and both ferryd (the destination asks the source over HTTPS first).
    c, k = cert
    monkeypatch.setenv("SSL_CERT_FILE", str(c))
    tls = ("--tls-cert", str(c), "--tls-key", str(k))
    a = helpers.start_ferryd(tmp_path / "a", *tls)
    b = helpers.start_ferryd(tmp_path / "b", *tls)
    try:
        data = helpers.pattern(1 << 20)
        ferry.Client(a.info["url"]).put("w", data)
        stats = ferry.Client(b.info["url"]).pull("w", a.info["url"])
        assert stats.bytes == 1 << 20
        assert bytes(ferry.Client(b.info["url"]).get("w")) == data.tobytes()
    finally:
        assert b.stop() == 0
        assert a.stop() == 0
    # Without the CA the client does not trust the node.
    monkeypatch.delenv("SSL_CERT_FILE")
    a = helpers.start_ferryd(tmp_path / "a", *tls)
    try:
        with pytest.raises(ferry.Unavailable, match="SSLServerVerification"):
            ferry.Client(a.info["url"]).put("x", helpers.pattern(16))
    finally:
        assert a.stop() == 0
