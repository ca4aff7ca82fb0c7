"""Loads libferry.so (the C ABI, client/include/ferry/ferry.h) and declares its functions."""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

from . import errors

c_char_pp = ctypes.POINTER(ctypes.c_char_p)


class Run(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_uint32), ("unused", ctypes.c_uint32),
                ("region", ctypes.c_uint64), ("offset", ctypes.c_uint64),
                ("piece", ctypes.c_uint64), ("stride", ctypes.c_uint64),
                ("count", ctypes.c_uint64)]


class CLayout(ctypes.Structure):
    _fields_ = [("runs", ctypes.POINTER(Run)), ("n_runs", ctypes.c_size_t),
                ("page_ids", ctypes.c_void_p), ("n_page_ids", ctypes.c_size_t)]


class PullSpec(ctypes.Structure):
    _fields_ = [("from_", ctypes.c_char_p), ("object", ctypes.c_char_p),
                ("version", ctypes.c_uint64), ("range_offset", ctypes.c_uint64),
                ("range_length", ctypes.c_uint64), ("source_extents", ctypes.c_void_p),
                ("n_source_extents", ctypes.c_size_t), ("new_buffer_device", ctypes.c_char_p),
                ("as_", ctypes.c_char_p), ("replace", ctypes.c_int), ("durable", ctypes.c_int),
                ("into", CLayout), ("prepared", ctypes.c_uint64), ("indices", ctypes.c_void_p),
                ("n_indices", ctypes.c_size_t), ("path", ctypes.c_char_p),
                ("timeout_ms", ctypes.c_uint64)]


class PullStats(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint64), ("bytes", ctypes.c_uint64),
                ("seconds", ctypes.c_double), ("rerouted_writes", ctypes.c_uint64),
                ("region", ctypes.c_uint64), ("path", ctypes.c_char * 16),
                ("via", ctypes.c_char * 16), ("source", ctypes.c_char * 256),
                ("tried", ctypes.c_void_p)]


def _candidates() -> list[str]:
    here = Path(__file__).resolve().parent
    found = [os.environ.get("FERRY_LIBRARY", "")]
    for base in (here, here.parent.parent, here.parent.parent.parent):
        found += [str(base / "libferry.so"), str(base / "build" / "client" / "libferry.so")]
    return [c for c in found if c and Path(c).is_file()] + ["libferry.so.0"]


def _load() -> ctypes.CDLL:
    tried = []
    for path in _candidates():
        try:
            return ctypes.CDLL(path)
        except OSError as e:
            tried.append(f"{path}: {e}")
    raise ImportError("ferry: cannot load libferry.so (set FERRY_LIBRARY to its path); tried "
                      + "; ".join(tried))


lib = _load()

_P = ctypes.c_void_p
_S = ctypes.c_char_p
_U64 = ctypes.c_uint64
_I = ctypes.c_int
_SIG = {
    "ferry_last_error": (_S, []),
    "ferry_free": (None, [_P]),
    "ferry_version": (_S, []),
    "ferry_client_open": (_I, [_S, _S, ctypes.POINTER(_P)]),
    "ferry_client_close": (None, [_P]),
    "ferry_client_health": (_I, [_P]),
    "ferry_client_put": (_I, [_P, _S, _P, ctypes.c_size_t, _S, _I, _S, ctypes.POINTER(_P)]),
    "ferry_client_put_file": (_I, [_P, _S, _S, _S, _I, _I, ctypes.POINTER(_P)]),
    "ferry_client_get": (_I, [_P, _S, _U64, ctypes.POINTER(_P), ctypes.POINTER(ctypes.c_size_t)]),
    "ferry_client_get_file": (_I, [_P, _S, _U64, _S]),
    "ferry_client_stat": (_I, [_P, _S, _U64, _I, ctypes.POINTER(_P)]),
    "ferry_client_list": (_I, [_P, _S, ctypes.c_size_t, ctypes.POINTER(_P)]),
    "ferry_client_distribute": (_I, [_P, _S, ctypes.POINTER(_P)]),
    "ferry_client_remove": (_I, [_P, _S]),
    "ferry_client_publish": (_I, [_P, _S, ctypes.POINTER(CLayout), _I, _I, _S, ctypes.POINTER(_P)]),
    "ferry_client_pull": (_I, [_P, ctypes.POINTER(PullSpec), ctypes.POINTER(PullStats)]),
    "ferry_node_start": (_I, [_S, ctypes.POINTER(_P)]),
    "ferry_node_stop": (None, [_P]),
    "ferry_node_url": (_S, [_P]),
    "ferry_node_id": (_S, [_P]),
    "ferry_node_register": (_I, [_P, _P, _U64, _S, ctypes.POINTER(_U64)]),
    "ferry_node_unregister": (_I, [_P, _U64]),
    "ferry_node_publish": (_I, [_P, _S, ctypes.POINTER(CLayout), _I, _I, _S, ctypes.POINTER(_P)]),
    "ferry_node_describe": (_I, [_P, _S, ctypes.POINTER(_P)]),
    "ferry_node_remove": (_I, [_P, _S]),
    "ferry_node_prepare": (_I, [_P, ctypes.POINTER(CLayout), ctypes.POINTER(_U64)]),
    "ferry_node_release": (_I, [_P, _U64]),
    "ferry_node_pull": (_I, [_P, ctypes.POINTER(PullSpec), ctypes.POINTER(PullStats)]),
    "ferry_node_pull_async": (_I, [_P, ctypes.POINTER(PullSpec), ctypes.POINTER(_P)]),
    "ferry_pull_wait": (_I, [_P, ctypes.c_int64, ctypes.POINTER(PullStats)]),
    "ferry_pull_done": (_I, [_P]),
    "ferry_pull_cancel": (_I, [_P, ctypes.POINTER(PullStats)]),
    "ferry_pull_free": (None, [_P]),
}
for _name, (_res, _args) in _SIG.items():
    _f = getattr(lib, _name)
    _f.restype = _res
    _f.argtypes = _args


def check(code: int) -> None:
    """Raises the exception of `code` (a ferry_code) with the library's message."""
    if code != 0:
        raise errors.from_code(code, lib.ferry_last_error().decode("utf-8", "replace"))


def take_string(p: ctypes.c_void_p) -> str:
    """The library's string at `p`, freed."""
    try:
        return ctypes.string_at(p.value).decode("utf-8") if p.value else ""
    finally:
        lib.ferry_free(p)


@functools.lru_cache(maxsize=4096)
def encode(s: str | None) -> bytes | None:
    """UTF-8 of `s` (None stays None); names and URLs come again and again."""
    return None if s is None else s.encode("utf-8")
