"""ferry: move named GPU and host buffers between machines over RDMA.

    import ferry
    with ferry.Node("/tmp/a") as node:
        region = node.register(numpy_array)
        node.publish("weights", region)

The package calls libferry.so (the C ABI) through ctypes: set FERRY_LIBRARY to its path when
it is not found next to the package or in the source tree's build/client/.
"""

from __future__ import annotations

from typing import Any, Mapping

from . import _lib
from .core import Client, Node, PullFuture, PullStats, Prepared, Region
from .errors import (Aborted, AlreadyExists, Cancelled, DataLoss, DeadlineExceeded,
                     FailedPrecondition, FerryError, Internal, InvalidArgument, NotFound,
                     OutOfRange, PermissionDenied, ResourceExhausted, Unauthenticated,
                     Unavailable, Unimplemented, Unknown)
from .layout import Extent, Layout, kv_pages
from .tensors import StateDictPulls, publish_state_dict, state_dict_layout, tensor_table

__version__ = _lib.lib.ferry_version().decode()


def pull_state_dict(node: Node, source: str, name: str, state_dict: Mapping[str, Any], *,
                    token: str | None = None, version: int | None = None, strict: bool = True,
                    **kw: Any) -> PullStats:
    """Pulls object `name` (published by publish_state_dict or `ferry put --safetensors`) from
    the node at `source` into the tensors of `state_dict`, by tensor name. Without `version`
    the source is asked for its latest version and table first (one HTTP request); with it, a
    table read before is used again. The tensors of a state dict pulled into before get the
    bytes through the destination prepared then. Keywords as Node.pull (path, timeout_ms)."""
    if node._state_dicts is None:
        node._state_dicts = StateDictPulls(node)
    info = node._state_dicts.table(source, name, version, token)
    dest = node._state_dicts.destination(info, state_dict, strict)
    return node.pull(source, name, dest, version=info["version"], **kw)


Node.publish_state_dict = publish_state_dict  # type: ignore[attr-defined]
Node.pull_state_dict = pull_state_dict  # type: ignore[attr-defined]

__all__ = [
    "Aborted", "AlreadyExists", "Cancelled", "Client", "DataLoss", "DeadlineExceeded", "Extent",
    "FailedPrecondition", "FerryError", "Internal", "InvalidArgument", "Layout", "Node",
    "NotFound", "OutOfRange", "PermissionDenied", "Prepared", "PullFuture", "PullStats",
    "Region", "ResourceExhausted", "Unauthenticated", "Unavailable", "Unimplemented", "Unknown",
    "kv_pages", "publish_state_dict", "pull_state_dict", "state_dict_layout", "tensor_table",
]
