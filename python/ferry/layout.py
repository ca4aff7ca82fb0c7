"""Layouts: the pieces of registered regions an object's bytes are taken from or a pull's bytes
go to, in order (ferry/layout.h): single extents, strided runs and page tables."""

from __future__ import annotations

import array
import ctypes
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from . import _lib
from .errors import InvalidArgument

_EXTENT, _STRIDED, _PAGES = 0, 1, 2


@dataclass(frozen=True)
class Extent:
    """`length` bytes at `offset` of region `region` (an id, or a Region)."""

    region: int
    offset: int
    length: int


def _region_id(region: Any) -> int:
    return region if isinstance(region, int) else region.id


def _uint32_buffer(ids: Any) -> tuple[Any, int, int]:
    """(owner, address, count) of `ids` as uint32: a numpy uint32 array is used as it is."""
    ai = getattr(ids, "__array_interface__", None)
    if ai is not None and ai["typestr"] in ("<u4", "=u4") and ids.flags["C_CONTIGUOUS"]:
        return ids, ai["data"][0], len(ids)
    try:
        buf = ids if isinstance(ids, array.array) and ids.typecode == "I" else array.array("I", ids)
    except (OverflowError, TypeError) as e:
        raise InvalidArgument(f"ids must be integers from 0 to 2**32-1: {e}") from None
    address, count = buf.buffer_info()
    return buf, address, count


class Layout:
    """Pieces of registered memory, in order. Build with add, add_strided, add_pages."""

    def __init__(self, extents: Iterable[Extent | tuple[Any, int, int]] = ()):
        self._runs: list[tuple[int, int, int, int, int, int]] = []
        self._pages: list[Any] = []  # page id buffers, one per PAGES run
        self.bytes = 0
        for e in extents:
            if isinstance(e, Extent):
                self.add(e.region, e.offset, e.length)
            else:
                self.add(*e)

    def add(self, region: Any, offset: int, length: int) -> "Layout":
        """`length` bytes at `offset` of `region`."""
        self._runs.append((_EXTENT, _region_id(region), offset, length, 0, 1))
        self.bytes += length
        return self

    def add_strided(self, region: Any, offset: int, piece: int, stride: int, count: int) -> "Layout":
        """`count` pieces of `piece` bytes at offset, offset + stride, ... of `region`."""
        self._runs.append((_STRIDED, _region_id(region), offset, piece, stride, count))
        self.bytes += piece * count
        return self

    def add_pages(self, region: Any, page_size: int, page_ids: Sequence[int] | Any,
                  offset: int = 0) -> "Layout":
        """Pages `page_ids` of `page_size` bytes of the pool at `offset` of `region`: page i is
        bytes [offset + i * page_size, + page_size). A numpy uint32 array is used without a copy."""
        owner, _, count = _uint32_buffer(page_ids)
        self._runs.append((_PAGES, _region_id(region), offset, page_size, 0, count))
        self._pages.append(owner)
        self.bytes += page_size * count
        return self

    def __len__(self) -> int:
        return len(self._runs)

    def c(self) -> tuple[_lib.CLayout, list[Any]]:
        """The C layout and what must stay alive while it is used."""
        n = len(self._runs)
        runs = (_lib.Run * n)()
        for i, (kind, region, offset, piece, stride, count) in enumerate(self._runs):
            r = runs[i]
            r.kind, r.region, r.offset, r.piece, r.stride, r.count = kind, region, offset, piece, stride, count
        keep: list[Any] = [runs]
        page_address, page_count = None, 0
        if len(self._pages) == 1:
            owner, page_address, page_count = _uint32_buffer(self._pages[0])
            keep.append(owner)
        elif self._pages:
            joined = array.array("I")
            for p in self._pages:
                joined.extend(array.array("I", p))
            page_address, page_count = joined.buffer_info()
            keep.append(joined)
        return _lib.CLayout(runs, n, page_address, page_count), keep


def kv_pages(pool: Any, page_size: int, page_ids: Sequence[int] | Any, offset: int = 0) -> Layout:
    """The layout of pages `page_ids` of a KV-cache pool (a Region) of `page_size`-byte pages."""
    return Layout().add_pages(pool, page_size, page_ids, offset)
