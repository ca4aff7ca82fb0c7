"""The Python package against real nodes: ferryd and embedded nodes in processes of their own,
over tcp on loopback."""

from __future__ import annotations

import gc
import json
import os
import signal
import struct
import subprocess
import sys

import numpy as np
import pytest

import ferry
import helpers
from helpers import PAGE, pattern


@pytest.fixture
def ferryd(tmp_path):
    d = helpers.start_ferryd(tmp_path / "ferryd")
    yield d
    assert d.stop() == 0


@pytest.fixture
def node(tmp_path):
    with ferry.Node(tmp_path / "local", sync=False) as n:
        yield n


def peer_fixture(mode):
    @pytest.fixture
    def f(tmp_path):
        p = helpers.start_peer(mode, tmp_path / f"peer-{mode}")
        yield p
        p.stop()
    return f


array_peer = peer_fixture("array")
state_dict_peer = peer_fixture("state_dict")
kv_peer = peer_fixture("kv")


# ---- Client (HTTP) ----

def test_client_put_get_stat_ls_rm(ferryd):
    with ferry.Client(ferryd.url) as c:
        c.health()
        data = pattern(3 * PAGE + 8).tobytes()
        info = c.put("models/a", data, meta={"kind": "test", "n": [1, 2]})
        assert (info["name"], info["version"], info["size"]) == ("models/a", 1, len(data))
        assert c.get("models/a") == data
        assert c.stat("models/a")["meta"] == {"kind": "test", "n": [1, 2]}
        with pytest.raises(ferry.AlreadyExists):
            c.put("models/a", b"x")
        assert c.put("models/a", b"second", replace=True)["version"] == 2
        assert c.get("models/a") == b"second"
        assert c.get("models/a", version=1) == data
        assert "meta" not in c.stat("models/a")
        assert [o["name"] for o in c.ls("models/")] == ["models/a"]
        assert c.ls("nothing/") == []
        c.rm("models/a")
        with pytest.raises(ferry.NotFound):
            c.stat("models/a")
        with pytest.raises(ferry.NotFound):
            c.rm("models/a")


def test_client_refuses_bad_input_and_changes_nothing(ferryd):
    with ferry.Client(ferryd.url) as c:
        with pytest.raises(ferry.InvalidArgument, match="name"):
            c.put("../escape", b"x")
        with pytest.raises(ferry.InvalidArgument, match="device"):
            c.put("a", b"x", device="tpu:0")
        with pytest.raises(ferry.InvalidArgument, match="meta"):
            c.put("a", b"x", meta="y" * (ferry_max_meta() + 1))
        assert c.ls() == []
    with pytest.raises(ferry.InvalidArgument, match="http://"):
        ferry.Client("ftp://nowhere")


def ferry_max_meta():
    return 1 << 20


def test_client_files(ferryd, tmp_path):
    src, out = tmp_path / "in.bin", tmp_path / "out.bin"
    src.write_bytes(pattern(1 << 20, seed=5).tobytes())
    with ferry.Client(ferryd.url) as c:
        assert c.put_file("f", src)["size"] == 1 << 20
        c.get_file("f", out)
        assert out.read_bytes() == src.read_bytes()
        with pytest.raises(ferry.NotFound):
            c.put_file("g", tmp_path / "missing.bin")


def test_client_token(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    d = helpers.start_ferryd(tmp_path / "d", "--token-file", str(token))
    try:
        with ferry.Client(d.url) as c:
            with pytest.raises(ferry.Unauthenticated):
                c.ls()
        with ferry.Client(d.url, token="wrong") as c:
            with pytest.raises(ferry.Unauthenticated):
                c.put("a", b"x")
        with ferry.Client(d.url, token="s3cret") as c:
            c.put("a", b"x")
            assert c.get("a") == b"x"
    finally:
        assert d.stop() == 0


def test_client_unavailable_when_nobody_listens(ferryd):
    port = ferryd.info["listen"].rsplit(":", 1)[1]
    assert ferryd.stop() == 0
    with ferry.Client(f"http://127.0.0.1:{port}") as c:
        with pytest.raises(ferry.Unavailable):
            c.health()


def test_client_asks_its_node_to_pull(ferryd, tmp_path):
    other = helpers.start_ferryd(tmp_path / "other")
    try:
        data = pattern(256 * 1024, seed=3).tobytes()
        with ferry.Client(ferryd.url) as a, ferry.Client(other.url) as b:
            a.put("w", data)
            stats = b.pull("w", ferryd.url, as_="w-copy")
            assert (stats.bytes, stats.path, stats.version) == (len(data), "rdma", 1)
            assert stats.region is not None
            assert b.get("w-copy") == data
            with pytest.raises(ferry.NotFound):
                b.pull("absent", ferryd.url)
    finally:
        assert other.stop() == 0


def test_client_distributes_an_object_to_many_nodes(ferryd, tmp_path):
    others = [helpers.start_ferryd(tmp_path / f"r{i}") for i in range(3)]
    try:
        data = pattern(3 * 1024 * 1024 + 7, seed=4).tobytes()
        with ferry.Client(ferryd.url) as a:
            a.put("w", data)
            r = a.distribute("w", [o.url for o in others], chunk_bytes=1 << 20)
            assert (r["version"], r["size"], r["chunks"]) == (1, len(data), 4)
            assert [x["ok"] for x in r["receivers"]] == [True, True, True]
            for o in others:
                with ferry.Client(o.url) as b:
                    assert b.get("w") == data
                    assert b.stat("w")["version"] == 1
            with pytest.raises(ferry.InvalidArgument):
                a.distribute("w")  # no receivers named
            with pytest.raises(ferry.NotFound):
                a.distribute("absent", [others[0].url])
    finally:
        for o in others:
            assert o.stop() == 0


# ---- Node (embedded) ----

def test_numpy_arrays_between_processes(node, array_peer):
    want = pattern(1 << 20)
    dest = np.zeros(1 << 20, np.uint8)
    region = node.register(dest)
    stats = node.pull(array_peer.url, "array", region)
    assert (stats.bytes, stats.path, stats.via) == (1 << 20, "rdma", "fabric")
    assert np.array_equal(dest, want)

    # Strided source into one contiguous range; a part by bytes; a part by source extents.
    rows = np.zeros(128 * PAGE, np.uint8)
    node.pull(array_peer.url, "rows", node.register(rows))
    assert np.array_equal(rows.reshape(128, PAGE), want.reshape(256, PAGE)[::2])
    part = np.zeros(PAGE, np.uint8)
    node.pull(array_peer.url, "array", node.register(part), byte_range=(3 * PAGE + 4, PAGE))
    assert np.array_equal(part, want[3 * PAGE + 4:4 * PAGE + 4])
    picked = np.zeros(2 * PAGE, np.uint8)
    node.pull(array_peer.url, "rows", node.register(picked), source_extents=[7, 2])
    assert np.array_equal(picked[:PAGE], want[14 * PAGE:15 * PAGE])
    assert np.array_equal(picked[PAGE:], want[4 * PAGE:5 * PAGE])


def test_pull_async_wait_and_cancel(node, array_peer):
    dest = np.zeros(1 << 20, np.uint8)
    region = node.register(dest)
    with node.pull_async(array_peer.url, "array", region) as f:
        stats = f.wait(timeout=30)
        assert f.done() and stats.bytes == 1 << 20
    assert np.array_equal(dest, pattern(1 << 20))

    # A source that does not run (stopped) answers nothing: wait times out, cancel returns.
    helpers.stop_process(array_peer.proc.pid)
    try:
        f = node.pull_async(array_peer.url, "array", region)
        with pytest.raises(ferry.DeadlineExceeded):
            f.wait(timeout=0.2)
        assert not f.done()
        with pytest.raises(ferry.Cancelled):
            f.cancel()
        f.close()
    finally:
        os.kill(array_peer.proc.pid, signal.SIGCONT)
    assert node.pull(array_peer.url, "array", region).bytes == 1 << 20


def test_a_dead_source_is_an_error_not_a_hang(node, array_peer):
    region = node.register(np.zeros(1 << 20, np.uint8))
    node.pull(array_peer.url, "array", region)
    array_peer.proc.kill()
    array_peer.proc.wait()
    with pytest.raises(ferry.Unavailable):
        node.pull(array_peer.url, "array", region, timeout_ms=5000)


def test_kv_pages_into_a_prepared_pool(node, kv_peer):
    src = pattern(64 * PAGE, seed=2).reshape(64, PAGE)
    pool = np.zeros((32, PAGE), np.uint8)
    region = node.register(pool)
    free = np.array([30, 1, 17, 4], np.uint32)
    with node.prepare(ferry.kv_pages(region, PAGE, free)) as slots:
        stats = node.pull(kv_peer.url, "req-7", slots)
        assert stats.bytes == 4 * PAGE
        for mine, theirs in zip(free, [5, 9, 2, 33]):
            assert np.array_equal(pool[mine], src[theirs])
        # Only some of the prepared pieces: the object's first two pages into slots 2 and 3.
        pool[:] = 0
        node.pull(kv_peer.url, "req-7", slots, indices=[2, 3], source_extents=[0, 1])
        assert np.array_equal(pool[17], src[5]) and np.array_equal(pool[4], src[9])
        assert not pool[30].any() and not pool[1].any()
    with pytest.raises(ferry.NotFound):
        node.pull(kv_peer.url, "req-7", slots)  # released


def test_register_and_publish(node, tmp_path):
    a = pattern(8 * PAGE)
    region = node.register(a)
    assert region.size == 8 * PAGE and region.device == "host"
    info = node.publish("a", region, meta={"why": "test"})
    assert info["size"] == 8 * PAGE and info["meta"] == {"why": "test"}
    assert node.describe("a")["extents"] == [{"region": region.id, "offset": 0, "length": 8 * PAGE}]
    with pytest.raises(ferry.FailedPrecondition):
        region.unregister()  # an object uses it
    with pytest.raises(ferry.AlreadyExists):
        node.publish("a", region)
    with pytest.raises(ferry.InvalidArgument, match="outside region"):
        node.publish("b", [(region, 4 * PAGE, 8 * PAGE)])
    with pytest.raises(ferry.NotFound):
        node.publish("b", [(region.id + 1000, 0, 1)])
    with pytest.raises(ferry.InvalidArgument, match="meta"):
        node.publish("b", region, meta=float("nan"))  # not JSON
    with pytest.raises(ferry.InvalidArgument, match="contiguous"):
        node.register(np.zeros((8, 8), np.uint8)[:, ::2])
    with pytest.raises(ferry.InvalidArgument, match="read-only"):
        node.register(memoryview(b"abc"))
    with pytest.raises(ferry.InvalidArgument, match="no memory"):
        node.register(42)
    with pytest.raises(ferry.InvalidArgument, match="device"):
        node.register(np.zeros(8, np.uint8), device="gpu")
    node.remove("a")
    region.unregister()
    with pytest.raises(ferry.NotFound):
        node.unregister(region.id)
    with pytest.raises(ferry.NotFound):
        node.describe("a")


def test_a_registered_buffer_is_kept_alive(node, array_peer):
    """The node holds what it registered: dropping the caller's reference frees nothing, and a
    bytearray cannot be resized under it."""
    buf = bytearray(1 << 20)
    region = node.register(buf)
    with pytest.raises(BufferError):
        buf.extend(b"more")
    del buf
    gc.collect()
    node.pull(array_peer.url, "array", region)
    assert bytes(region.owner[0]) == pattern(1 << 20).tobytes()
    region.unregister()
    assert region.id not in node._regions


def test_node_options_are_checked(tmp_path):
    with pytest.raises(ferry.InvalidArgument, match="listen"):
        ferry.Node(tmp_path / "x", listen="nowhere")
    with pytest.raises(ferry.Unavailable):
        with ferry.Node(tmp_path / "y") as n:
            ferry.Node(tmp_path / "y")  # the catalog is locked by n


# ---- Tensors ----

def test_state_dict_by_tensor_name(node, state_dict_peer):
    want = helpers.state_dict(seed=1)
    got = helpers.zeros_like(want)
    stats = ferry.pull_state_dict(node, state_dict_peer.url, "model", got)
    assert stats.bytes == sum(v.nbytes for v in want.values())
    for k in want:
        assert np.array_equal(got[k], want[k]), k
    # Into tensors of another order: by name, not by position.
    reversed_dict = dict(reversed(list(helpers.zeros_like(want).items())))
    node.pull_state_dict(state_dict_peer.url, "model", reversed_dict)
    for k in want:
        assert np.array_equal(reversed_dict[k], want[k]), k


def test_a_state_dict_pulled_again_follows_its_tensors(node, state_dict_peer):
    """The destination prepared for a state dict is used again only while the dict holds the
    same tensors: a tensor put in its place gets the bytes, a wrong one is refused."""
    want = helpers.state_dict(seed=1)
    got = helpers.zeros_like(want)
    v = ferry.pull_state_dict(node, state_dict_peer.url, "model", got).version
    ferry.pull_state_dict(node, state_dict_peer.url, "model", got, version=v)
    assert len(node._state_dicts.dests) == 1
    old = got["embed.weight"]
    got["embed.weight"] = np.zeros_like(old)
    old[:] = 0
    ferry.pull_state_dict(node, state_dict_peer.url, "model", got, version=v)
    assert np.array_equal(got["embed.weight"], want["embed.weight"]) and not old.any()
    got["layer0.bias"] = np.zeros(32, np.float32)
    with pytest.raises(ferry.InvalidArgument, match="tensor 'layer0.bias'"):
        ferry.pull_state_dict(node, state_dict_peer.url, "model", got, version=v)
    with pytest.raises(ferry.NotFound):
        ferry.pull_state_dict(node, state_dict_peer.url, "model", got, version=v + 1)


def test_state_dict_mismatches_name_the_tensor(node, state_dict_peer):
    base = helpers.zeros_like(helpers.state_dict())
    wrong_dtype = dict(base, **{"layer0.bias": np.zeros(32, np.float32)})
    with pytest.raises(ferry.InvalidArgument, match="tensor 'layer0.bias': dtype F32 here, F64"):
        ferry.pull_state_dict(node, state_dict_peer.url, "model", wrong_dtype)
    wrong_shape = dict(base, **{"embed.weight": np.zeros((32, 64), np.float32)})
    with pytest.raises(ferry.InvalidArgument, match=r"tensor 'embed.weight': shape \[32, 64\]"):
        ferry.pull_state_dict(node, state_dict_peer.url, "model", wrong_shape)
    missing = {k: v for k, v in base.items() if k != "head.codes"}
    with pytest.raises(ferry.InvalidArgument, match="tensor 'head.codes' .* not in the state dict"):
        ferry.pull_state_dict(node, state_dict_peer.url, "model", missing)
    extra = dict(base, extra=np.zeros(4, np.float32))
    with pytest.raises(ferry.InvalidArgument, match="not in object 'model': extra"):
        ferry.pull_state_dict(node, state_dict_peer.url, "model", extra)
    ferry.pull_state_dict(node, state_dict_peer.url, "model", extra, strict=False)
    node.publish("plain", node.register(np.zeros(8, np.uint8)))
    with pytest.raises(ferry.InvalidArgument, match="no tensor table"):
        ferry.pull_state_dict(node, node.url, "plain", base)


def write_safetensors(path, tensors, header_override=None):
    """A safetensors file: u64 header length, JSON header, the tensors' bytes back to back."""
    header, blobs, offset = {"__metadata__": {"format": "np"}}, [], 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = header_override if header_override is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def safetensors_tensors():
    rng = np.random.default_rng(9)
    f32 = rng.standard_normal((4, 8)).astype(np.float32)
    i64 = rng.integers(-5, 5, size=(6,), dtype=np.int64)
    bf16 = rng.integers(0, 1 << 16, size=(2, 3), dtype=np.uint16)  # raw BF16 bits
    return {
        "w": ("F32", [4, 8], f32.tobytes()),
        "ids": ("I64", [6], i64.tobytes()),
        "empty": ("F16", [0], b""),
        "half": ("BF16", [2, 3], bf16.tobytes()),
    }, {"w": f32, "ids": i64, "half": bf16}


def test_safetensors_put_and_pull(ferryd, node, tmp_path):
    path = tmp_path / "model.safetensors"
    tensors, arrays = safetensors_tensors()
    write_safetensors(path, tensors)
    with ferry.Client(ferryd.url) as c:
        info = c.put_file("ckpt", path, safetensors=True)
        assert info["size"] == sum(len(t[2]) for t in tensors.values())
        table = {t["name"]: t for t in ferry.tensor_table(c.stat("ckpt"))}
        assert table["half"] == {"name": "half", "dtype": "BF16", "shape": [2, 3],
                                 "offset": table["half"]["offset"]}
        assert set(table) == {"w", "ids", "empty", "half"}
    # BF16 has no numpy dtype: a torch-free receiver pulls it by bytes; here through a table
    # that names a U16 array as BF16 is refused, so pull the others by range.
    got = {"w": np.zeros((4, 8), np.float32), "ids": np.zeros(6, np.int64)}
    for k, a in got.items():
        t = table[k]
        node.pull(ferryd.url, "ckpt", node.register(a), byte_range=(t["offset"], a.nbytes))
        assert np.array_equal(a, arrays[k]), k
    with pytest.raises(ferry.InvalidArgument, match="tensor 'half': dtype U16 here, BF16"):
        ferry.pull_state_dict(node, ferryd.url, "ckpt",
                              {"w": got["w"], "ids": got["ids"], "empty": np.zeros(0, np.float16),
                               "half": np.zeros((2, 3), np.uint16)})


@pytest.mark.parametrize("header,why", [
    (b"{not json", "not a JSON object"),
    (json.dumps({"w": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]}}).encode(),
     "unknown dtype Q7"),
    (json.dumps({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}).encode(),
     "8 bytes for its shape of 3 x 4"),
    (json.dumps({"w": {"dtype": "U8", "shape": [64], "data_offsets": [0, 64]}}).encode(),
     "outside the"),
    (json.dumps({"w": {"dtype": "U8", "shape": [1]}}).encode(), "wants dtype, shape and data_offsets"),
])
def test_safetensors_bad_files_are_refused(ferryd, tmp_path, header, why):
    path = tmp_path / "bad.safetensors"
    write_safetensors(path, {"w": ("U8", [8], bytes(8))}, header_override=header)
    with ferry.Client(ferryd.url) as c:
        with pytest.raises(ferry.InvalidArgument, match=why):
            c.put_file("bad", path, safetensors=True)
        assert c.ls() == []
    short = tmp_path / "short.safetensors"
    short.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with ferry.Client(ferryd.url) as c, pytest.raises(ferry.InvalidArgument, match="header of"):
        c.put_file("bad", short, safetensors=True)


def test_cli_put_safetensors(ferryd, tmp_path):
    path = tmp_path / "m.safetensors"
    tensors, _ = safetensors_tensors()
    write_safetensors(path, tensors)
    r = subprocess.run([str(helpers.FERRY_CLI), "--node", ferryd.url, "put", "--safetensors",
                        "ckpt", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    with ferry.Client(ferryd.url) as c:
        assert {t["name"] for t in ferry.tensor_table(c.stat("ckpt"))} == set(tensors)
        data = path.read_bytes()
        start = 8 + struct.unpack("<Q", data[:8])[0]
        assert c.get("ckpt") == data[start:]
    write_safetensors(path, {}, header_override=b"[]")
    r = subprocess.run([str(helpers.FERRY_CLI), "--node", ferryd.url, "put", "--safetensors",
                        "bad", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "not a JSON object" in r.stderr


# ---- Errors ----

def test_every_code_has_its_class():
    names = ["Cancelled", "Unknown", "InvalidArgument", "DeadlineExceeded", "NotFound",
             "AlreadyExists", "PermissionDenied", "ResourceExhausted", "FailedPrecondition",
             "Aborted", "OutOfRange", "Unimplemented", "Internal", "Unavailable", "DataLoss",
             "Unauthenticated"]
    for code, name in enumerate(names, start=1):
        e = ferry.errors.from_code(code, "why")
        assert type(e).__name__ == name and e.code == code and str(e) == "why"
        assert isinstance(e, ferry.FerryError)
    assert isinstance(ferry.errors.from_code(99, "x"), ferry.Unknown)
    assert issubclass(ferry.InvalidArgument, ValueError)
    assert issubclass(ferry.NotFound, LookupError)


# ---- Examples ----

@pytest.mark.parametrize("example,args", [("weight_sync.py", ["--steps", "2"]),
                                          ("kv_migration.py", ["--requests", "3"]),
                                          ("rest_fetch.py", [])])
def test_examples_run(example, args):
    path = helpers.HERE.parent.parent / "client" / "examples" / "python" / example
    r = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "DIFFER" not in r.stdout


def test_client_publishes_over_the_nodes_regions(ferryd):
    with ferry.Client(ferryd.url) as c:
        data = pattern(4 * PAGE, seed=8).tobytes()
        region = c.put("blob", data)["extents"][0]["region"]
        info = c.publish("second-half", [(region, 2 * PAGE, 2 * PAGE)], meta=[1, 2])
        assert (info["size"], info["meta"]) == (2 * PAGE, [1, 2])
        assert c.get("second-half") == data[2 * PAGE:]
        out = bytearray(4 * PAGE)
        assert c.get("blob", out=out) == 4 * PAGE and bytes(out) == data
        with pytest.raises(ferry.OutOfRange):
            c.get("blob", out=bytearray(PAGE))
        with pytest.raises(ferry.NotFound):
            c.publish("x", [(region + 99, 0, 1)])
        with pytest.raises(ferry.InvalidArgument, match="a layout must be"):
            c.publish("x", np.zeros(4))


def test_tensors_and_buffers_are_layouts_of_a_node(node, array_peer):
    a, b = np.zeros(PAGE, np.uint8), bytearray(PAGE)
    node.pull(array_peer.url, "array", [a, b], byte_range=(0, 2 * PAGE))
    want = pattern(1 << 20)
    assert np.array_equal(a, want[:PAGE]) and bytes(b) == want[PAGE:2 * PAGE].tobytes()
    info = node.publish("both", [a, b])
    assert info["size"] == 2 * PAGE and len(info["extents"]) == 2
    with node.register(np.zeros(8, np.uint8)) as r:
        assert r.id in node._regions
    assert r.id not in node._regions
