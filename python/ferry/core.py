"""ferry.Client (a node's HTTP API) and ferry.Node (a node in this process)."""

from __future__ import annotations

import ctypes
import json
import os
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from . import _lib
from .buffers import Memory, memory_of
from .errors import InvalidArgument, OutOfRange
from .layout import Extent, Layout, _uint32_buffer

_check = _lib.check
_enc = _lib.encode
lib = _lib.lib


@dataclass
class PullStats:
    """What a pull did: bytes, seconds from the first WRITE to the last completion, the path
    ("rdma", "cuda_ipc" or "staged"), how the nodes talked ("fabric", "http", "local"); for a
    pull by name (no source given), the holder it came from and those that failed before it."""

    version: int
    bytes: int
    seconds: float
    path: str
    via: str
    rerouted_writes: int
    region: int | None  # the new buffer's region, for a pull into one
    source: str | None = None  # a pull by name: the holder's URL
    tried: list[str] | None = None  # ... and "node at url: why" of each holder that failed first

    @staticmethod
    def of(s: _lib.PullStats) -> "PullStats":
        tried = json.loads(_lib.take_string(ctypes.c_void_p(s.tried))) if s.tried else []
        return PullStats(s.version, s.bytes, s.seconds, s.path.decode(), s.via.decode(),
                         s.rerouted_writes, s.region or None, s.source.decode() or None, tried)


def _json_out(call: Any, *args: Any) -> Any:
    out = ctypes.c_void_p()
    _check(call(*args, ctypes.byref(out)))
    return json.loads(_lib.take_string(out))


def _meta_text(meta: Any) -> bytes | None:
    return None if meta is None else json.dumps(meta, separators=(",", ":")).encode()


def _spec(source: str | None, name: str, *, node: "Node | None" = None, into: Any = None, version: int | None = None,
          byte_range: tuple[int, int] | None = None, source_extents: Sequence[int] | None = None,
          new_buffer: str | None = None, as_: str | None = None, replace: bool = False,
          durable: bool = True, indices: Sequence[int] | Any = None, path: str = "auto",
          timeout_ms: int = 0) -> tuple[_lib.PullSpec, list[Any]]:
    """The C pull spec and what must stay alive while it is used."""
    s = _lib.PullSpec()
    keep: list[Any] = []
    s.from_, s.object, s.version = _enc(source), _enc(name), version or 0
    if byte_range is not None:
        s.range_offset, s.range_length = byte_range
    if source_extents is not None:
        owner, s.source_extents, s.n_source_extents = _uint32_buffer(source_extents)
        keep.append(owner)
    s.new_buffer_device, s.as_ = _enc(new_buffer), _enc(as_)
    s.replace, s.durable = int(replace), int(durable)
    if isinstance(into, Prepared):
        s.prepared = into.handle
    elif isinstance(into, Region):
        s.into = into._c_layout()
    elif into is not None:
        s.into, held = _layout_of(into, node).c()
        keep.append(held)
    if indices is not None:
        owner, s.indices, s.n_indices = _uint32_buffer(indices)
        keep.append(owner)
    s.path, s.timeout_ms = _enc(path), timeout_ms
    return s, keep


def _layout_of(x: Any, node: "Node | None" = None) -> Layout:
    """A Layout from a Layout, a Region (all of it), extents ((region, offset, length) or
    Extent), or, given the node, tensors and buffers (each all of it, registered once)."""
    if isinstance(x, Layout):
        return x
    if isinstance(x, Region):
        return Layout().add(x, 0, x.size)
    items = x if isinstance(x, list) else [x]
    if all(isinstance(e, (Extent, tuple)) for e in items):
        return Layout(items)
    if node is None:
        raise InvalidArgument(f"a layout must be a Layout, a Region or a list of extents, not "
                              f"{type(x).__name__}")
    layout = Layout()
    for e in items:
        region = e if isinstance(e, Region) else node._region_for(e)
        layout.add(region, 0, region.size)
    return layout


class Client:
    """A node's HTTP API (ferry::Client). One per thread."""

    def __init__(self, url: str, token: str | None = None):
        self._h = None
        h = ctypes.c_void_p()
        _check(lib.ferry_client_open(_enc(url), _enc(token), ctypes.byref(h)))
        self._h = h
        self.url = url

    def close(self) -> None:
        if self._h:
            lib.ferry_client_close(self._h)
            self._h = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def health(self) -> None:
        """Raises unless the node answers."""
        _check(lib.ferry_client_health(self._h))

    def put(self, name: str, data: Any, *, device: str = "host", replace: bool = False,
            meta: Any = None) -> dict:
        """Uploads `data` (bytes or any buffer) as object `name`; `meta`: JSON-able, kept with it."""
        if isinstance(data, (bytes, bytearray)) and not data:
            addr, size = None, 0  # an empty object: the node refuses it with its reason
        else:
            m = memory_of(data)
            addr, size = m.addr, m.size
        return _json_out(lib.ferry_client_put, self._h, _enc(name), addr, size, _enc(device),
                         int(replace), _meta_text(meta))

    def put_file(self, name: str, path: str | os.PathLike, *, device: str = "host",
                 replace: bool = False, safetensors: bool = False) -> dict:
        """Uploads a file; with `safetensors`, a checkpoint's tensors with their table."""
        return _json_out(lib.ferry_client_put_file, self._h, _enc(name), _enc(os.fspath(path)),
                         _enc(device), int(replace), int(safetensors))

    def get(self, name: str, version: int | None = None, out: Any = None) -> bytes | int:
        """The object's bytes; with `out` (a writable buffer or array of at least its size),
        written there instead, and the count returned (OutOfRange when it does not fit)."""
        data, size = ctypes.c_void_p(), ctypes.c_size_t()
        _check(lib.ferry_client_get(self._h, _enc(name), version or 0, ctypes.byref(data),
                                    ctypes.byref(size)))
        try:
            if out is None:
                return ctypes.string_at(data.value, size.value) if size.value else b""
            m = memory_of(out)
            if m.device != "host":
                raise InvalidArgument("get writes into host memory only")
            if m.size < size.value:
                raise OutOfRange(f"{size.value} bytes do not fit in {m.size}")
            ctypes.memmove(m.addr, data.value, size.value)
            return size.value
        finally:
            lib.ferry_free(data)

    def get_file(self, name: str, path: str | os.PathLike, version: int | None = None) -> None:
        _check(lib.ferry_client_get_file(self._h, _enc(name), version or 0,
                                         _enc(os.fspath(path))))

    def stat(self, name: str, version: int | None = None, extents: bool = True) -> dict:
        """The object's description (docs/http_api.md), its meta under "meta"; without its
        layout when `extents` is False."""
        return _json_out(lib.ferry_client_stat, self._h, _enc(name), version or 0, int(extents))

    def ls(self, prefix: str = "", limit: int = 1000) -> list[dict]:
        return _json_out(lib.ferry_client_list, self._h, _enc(prefix), limit)

    def rm(self, name: str) -> None:
        _check(lib.ferry_client_remove(self._h, _enc(name)))

    def publish(self, name: str, layout: Any, *, replace: bool = False, durable: bool = True,
                meta: Any = None) -> dict:
        """Publishes a layout over the node's regions (ids as the node gave them)."""
        c, keep = _layout_of(layout).c()
        return _json_out(lib.ferry_client_publish, self._h, _enc(name), ctypes.byref(c),
                         int(replace), int(durable), _meta_text(meta))

    def pull(self, name: str, source: str | None = None, *, as_: str | None = None,
             device: str = "host", replace: bool = False, path: str = "auto",
             **kw: Any) -> PullStats:
        """Makes this client's node pull `name` from `source` into a new buffer on `device`
        (source None: from a holder the node's directory names)."""
        s, keep = _spec(source, name, new_buffer=device, as_=as_, replace=replace, path=path, **kw)
        out = _lib.PullStats()
        _check(lib.ferry_client_pull(self._h, ctypes.byref(s), ctypes.byref(out)))
        return PullStats.of(out)


    def distribute(self, name: str, to: list[str] | None = None, *,
                   labels: dict[str, str] | None = None, all: bool = False,
                   version: int | None = None, chunk_bytes: int | None = None,
                   checksum: bool = True, device: str = "host", durable: bool = True,
                   timeout_ms: int | None = None) -> dict:
        """Makes this client's node deliver `name` to many nodes at once, in a chain: the
        receivers `to` (URLs, in chain order), or the directory's nodes with `labels`, or `all`
        of them. Returns the answer of POST /v1/distribute: each receiver's outcome under
        "receivers" (a receiver that failed does not raise; one that could not start does)."""
        spec: dict[str, Any] = {"object": name, "checksum": checksum, "device": device,
                                "durable": durable}
        if to is not None:
            spec["to"] = list(to)
        if labels:
            spec["labels"] = dict(labels)
        if all:
            spec["all"] = True
        for key, value in (("version", version), ("chunk_bytes", chunk_bytes),
                           ("timeout_ms", timeout_ms)):
            if value is not None:
                spec[key] = value
        return _json_out(lib.ferry_client_distribute, self._h, _enc(json.dumps(spec)))


class Region:
    """Memory registered with a node. The node keeps the memory's owner alive until unregister."""

    def __init__(self, node: "Node", id: int, memory: Memory):
        self.node, self.id, self.memory = node, id, memory
        self._c: tuple | None = None

    @property
    def size(self) -> int:
        return self.memory.size

    @property
    def device(self) -> str:
        return self.memory.device

    @property
    def owner(self) -> Any:
        return self.memory.owner

    def _c_layout(self) -> _lib.CLayout:
        """All of the region as a C layout, made once (it holds its run array)."""
        if self._c is None:
            self._c = Layout().add(self, 0, self.size).c()
        return self._c[0]

    def extent(self, offset: int = 0, length: int | None = None) -> Extent:
        return Extent(self.id, offset, self.size - offset if length is None else length)

    def unregister(self) -> None:
        self.node.unregister(self)

    def __enter__(self) -> "Region":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.unregister()


class Prepared:
    """A destination prepared once (a KV pool's slots); pulls fill all of it or `indices`."""

    def __init__(self, node: "Node", handle: int, layout: Layout):
        self.node, self.handle, self.layout = node, handle, layout
        self.released = False

    def release(self) -> None:
        """Revokes the sources' access to it; a pull naming it then fails with NotFound."""
        if not self.released:
            _check(lib.ferry_node_release(self.node._h, self.handle))
            self.released = True

    def __enter__(self) -> "Prepared":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


class PullFuture:
    """A pull under way (Node.pull_async)."""

    def __init__(self, h: ctypes.c_void_p, keep: list[Any]):
        self._h, self._keep = h, keep

    def wait(self, timeout: float | None = None) -> PullStats:
        """The pull's stats once it ends; DeadlineExceeded after `timeout` seconds (it goes on)."""
        out = _lib.PullStats()
        ms = -1 if timeout is None else int(timeout * 1000)
        _check(lib.ferry_pull_wait(self._h, ms, ctypes.byref(out)))
        return PullStats.of(out)

    def done(self) -> bool:
        return bool(lib.ferry_pull_done(self._h))

    def cancel(self) -> PullStats:
        """Stops the pull; returns once none of its WRITEs can land any more."""
        out = _lib.PullStats()
        _check(lib.ferry_pull_cancel(self._h, ctypes.byref(out)))
        return PullStats.of(out)

    def close(self) -> None:
        if self._h:
            lib.ferry_pull_free(self._h)
            self._h = None

    def __enter__(self) -> "PullFuture":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class Node:
    """A ferry node in this process (ferry::EmbeddedNode): register memory, publish layouts
    over it, pull other nodes' objects into it. It serves the HTTP API at `url` too."""

    def __init__(self, data_dir: str | os.PathLike = "./ferry-data", *, provider: str = "tcp",
                 rails: int = 1, listen: str = "127.0.0.1:0", token: str | None = None,
                 peer_transport: str = "auto", sync: bool = True,
                 domains: Sequence[str] | None = None):
        options = {"data_dir": os.fspath(data_dir), "provider": provider, "rails": rails,
                   "listen": listen, "peer_transport": peer_transport, "sync": sync}
        if token:
            options["token"] = token
        if domains:
            options["domains"] = list(domains)
        self._h = None
        h = ctypes.c_void_p()
        _check(lib.ferry_node_start(json.dumps(options).encode(), ctypes.byref(h)))
        self._h = h
        self.url: str = lib.ferry_node_url(h).decode()
        self.id: str = lib.ferry_node_id(h).decode()
        self._regions: dict[int, Region] = {}
        self._tensor_regions: dict[tuple[int, int, str], Region] = {}
        self._state_dicts: Any = None  # tensors.StateDictPulls, made at the first pull of one

    def stop(self) -> None:
        """Stops serving, waits for running pulls, closes the node."""
        if self._h:
            lib.ferry_node_stop(self._h)
            self._h = None
            self._regions.clear()
            self._tensor_regions.clear()
            self._state_dicts = None

    def __enter__(self) -> "Node":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __del__(self) -> None:
        self.stop()

    # Memory.
    def register(self, buf: Any, device: str | None = None) -> Region:
        """Registers the memory of `buf` (a buffer, numpy array, torch tensor on CPU or CUDA,
        or __cuda_array_interface__ array). The node keeps `buf` alive until unregister."""
        m = memory_of(buf, device)
        rid = ctypes.c_uint64()
        _check(lib.ferry_node_register(self._h, m.addr, m.size, _enc(m.device), ctypes.byref(rid)))
        region = Region(self, rid.value, m)
        self._regions[region.id] = region
        return region

    def unregister(self, region: Region | int) -> None:
        """FailedPrecondition while an object or prepared destination uses it."""
        rid = region if isinstance(region, int) else region.id
        _check(lib.ferry_node_unregister(self._h, rid))
        gone = self._regions.pop(rid, None)
        if gone is not None:
            m = gone.memory
            self._tensor_regions.pop((m.addr, m.size, m.device), None)

    def _region_for(self, tensor: Any) -> Region:
        """A region over exactly `tensor`'s memory, registered once."""
        m = memory_of(tensor)
        key = (m.addr, m.size, m.device)
        region = self._tensor_regions.get(key)
        if region is None:
            region = self.register(tensor)
            self._tensor_regions[key] = region
        return region

    # Objects.
    def publish(self, name: str, layout: Any, *, replace: bool = False, durable: bool = True,
                meta: Any = None) -> dict:
        """Publishes `layout` as `name`: a Layout, a Region, extents, or a tensor or buffer (or a
        list of them: their bytes one after the other, each registered once). `meta`
        (JSON-able) is kept with the version. durable=False: in memory only (KV pages)."""
        c, keep = _layout_of(layout, self).c()
        return _json_out(lib.ferry_node_publish, self._h, _enc(name), ctypes.byref(c),
                         int(replace), int(durable), _meta_text(meta))

    def describe(self, name: str) -> dict:
        return _json_out(lib.ferry_node_describe, self._h, _enc(name))

    def remove(self, name: str) -> None:
        _check(lib.ferry_node_remove(self._h, _enc(name)))

    def prepare(self, layout: Any) -> Prepared:
        """A destination registered once: later pulls name it and fill it or some of its pieces."""
        lay = _layout_of(layout, self)
        c, keep = lay.c()
        handle = ctypes.c_uint64()
        _check(lib.ferry_node_prepare(self._h, ctypes.byref(c), ctypes.byref(handle)))
        return Prepared(self, handle.value, lay)

    # Pulls.
    def pull(self, source: str | None, name: str, into: Any = None, **kw: Any) -> PullStats:
        """Pulls object `name` from the node at `source` (None: from a holder the node's
        directory names) into `into` (a Layout, a Region,
        extents, tensors or buffers, or a Prepared; or new_buffer="host"/"cuda:N"). Keywords: version,
        byte_range=(offset, length), source_extents, indices (of a Prepared), path, timeout_ms,
        as_, replace, durable."""
        s, keep = _spec(source, name, node=self, into=into, **kw)
        out = _lib.PullStats()
        _check(lib.ferry_node_pull(self._h, ctypes.byref(s), ctypes.byref(out)))
        return PullStats.of(out)

    pull_into = pull

    def pull_async(self, source: str | None, name: str, into: Any = None, **kw: Any) -> PullFuture:
        """As pull; returns once the request is on its way."""
        s, keep = _spec(source, name, node=self, into=into, **kw)
        h = ctypes.c_void_p()
        _check(lib.ferry_node_pull_async(self._h, ctypes.byref(s), ctypes.byref(h)))
        return PullFuture(h, keep)
