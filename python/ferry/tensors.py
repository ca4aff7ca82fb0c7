"""Tensors as objects: a state dict published as one object with its tensor table as the meta
(docs/tensors.md), and pulled by tensor name into tensors the receiver already has."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Mapping

from .buffers import is_torch_tensor, memory_of
from .errors import FerryError, InvalidArgument
from .layout import Layout


def tensor_table(info: dict) -> list[dict]:
    """The tensor table of an object description, in the object's byte order."""
    meta = info.get("meta")
    if not isinstance(meta, dict) or not isinstance(meta.get("tensors"), list):
        raise InvalidArgument(f"object '{info.get('name')}' carries no tensor table")
    return sorted(meta["tensors"], key=lambda t: t["offset"])


def publish_state_dict(node: Any, name: str, state_dict: Mapping[str, Any], *,
                       replace: bool = False, durable: bool = True) -> dict:
    """Publishes the tensors of `state_dict` (torch tensors or numpy arrays, contiguous) as one
    object `name`, in their order, with their table. The tensors stay registered with `node`."""
    layout, table, offset = Layout(), [], 0
    for key, tensor in state_dict.items():
        m = memory_of(tensor)
        if m.dtype is None:
            raise InvalidArgument(f"tensor '{key}': its dtype has no name in ferry's tensor table")
        table.append({"name": key, "dtype": m.dtype, "shape": list(m.shape or ()), "offset": offset})
        if m.size > 0:
            layout.add(node._region_for(tensor), 0, m.size)
        offset += m.size
    return node.publish(name, layout, replace=replace, durable=durable, meta={"tensors": table})


def state_dict_layout(node: Any, info: dict, state_dict: Mapping[str, Any],
                      strict: bool = True) -> Layout:
    """Where the object described by `info` goes in `state_dict`, tensor by tensor. A missing
    tensor, or one whose dtype or shape differs, is InvalidArgument naming it."""
    layout, seen, end = Layout(), set(), 0
    for t in tensor_table(info):
        key = t["name"]
        if key not in state_dict:
            raise InvalidArgument(f"tensor '{key}' of object '{info['name']}' is not in the state dict")
        m = memory_of(state_dict[key])
        if m.dtype != t["dtype"]:
            raise InvalidArgument(f"tensor '{key}': dtype {m.dtype} here, {t['dtype']} in the object")
        if list(m.shape or ()) != list(t["shape"]):
            raise InvalidArgument(f"tensor '{key}': shape {list(m.shape or ())} here, {t['shape']} in "
                                  "the object")
        if t["offset"] != end:
            raise InvalidArgument(f"tensor '{key}' starts at byte {t['offset']}, not {end}: the "
                                  "table does not cover the object")
        if m.size > 0:
            layout.add(node._region_for(state_dict[key]), 0, m.size)
        end += m.size
        seen.add(key)
    if end != info["size"]:
        raise InvalidArgument(f"the tensor table covers {end} of the object's {info['size']} bytes")
    extra = [k for k in state_dict if k not in seen]
    if strict and extra:
        raise InvalidArgument(f"tensors not in object '{info['name']}': {', '.join(extra[:8])}")
    return layout


class StateDictPulls:
    """What a node keeps between pulls of state dicts: the tables of object versions it has read
    (a version never changes), and per state dict a destination prepared once over its tensors,
    used again while the dict holds the same tensors (identity, and torch's data_ptr)."""

    MAX = 16  # of each

    def __init__(self, node: Any):
        self.node = node
        self.tables: OrderedDict[tuple, dict] = OrderedDict()
        self.dests: OrderedDict[tuple, tuple] = OrderedDict()

    def table(self, source: str, name: str, version: int | None, token: str | None) -> dict:
        """The description of `name` at `source` (version None: the latest, asked every time)."""
        key = (source, name, version)
        if version is not None and key in self.tables:
            self.tables.move_to_end(key)
            return self.tables[key]
        from .core import Client
        with Client(source, token) as c:
            info = c.stat(name, version, extents=False)
        info["_key"] = tuple((t["name"], t["dtype"], tuple(t["shape"]), t["offset"])
                             for t in tensor_table(info))
        self.tables[(source, name, info["version"])] = info
        if len(self.tables) > self.MAX:
            self.tables.popitem(last=False)
        return info

    def destination(self, info: dict, state_dict: Mapping[str, Any], strict: bool) -> Any:
        """A prepared destination of the object's bytes in `state_dict`'s tensors."""
        key = (id(state_dict), info["_key"], strict)
        kept = self.dests.get(key)
        if kept is not None:
            tensors, ptrs, size, prepared = kept
            names = [t[0] for t in info["_key"]]
            if (len(state_dict) == size and
                    all(state_dict.get(n) is t for n, t in zip(names, tensors)) and
                    all(p is None or t.data_ptr() == p for t, p in zip(tensors, ptrs))):
                self.dests.move_to_end(key)
                return prepared
            self.dests.pop(key)
            self._release(prepared)
        prepared = self.node.prepare(state_dict_layout(self.node, info, state_dict, strict))
        tensors = [state_dict[t[0]] for t in info["_key"]]
        ptrs = [t.data_ptr() if is_torch_tensor(t) else None for t in tensors]
        self.dests[key] = (tensors, ptrs, len(state_dict), prepared)
        if len(self.dests) > self.MAX:
            self._release(self.dests.popitem(last=False)[1][3])
        return prepared

    @staticmethod
    def _release(prepared: Any) -> None:
        try:
            prepared.release()
        except FerryError:
            pass  # the node is gone: so is the destination
