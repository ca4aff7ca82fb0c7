"""Tensors as objects: a state dict published as one object with its tensor table as the meta
(docs/tensors.md), and pulled by tensor name into tensors the receiver already has."""

from __future__ import annotations

from typing import Any, Mapping

from .buffers import memory_of
from .errors import InvalidArgument
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
