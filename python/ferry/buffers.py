"""Where an object's memory is: torch tensors, __cuda_array_interface__ arrays, numpy arrays and
anything with the buffer protocol, without importing torch or numpy."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

from .errors import InvalidArgument

# dtype names of the tensor table (safetensors' names) by torch's and numpy's names.
_TORCH_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint64": "U64", "uint32": "U32", "uint16": "U16",
    "uint8": "U8", "bool": "BOOL",
}
_NUMPY_DTYPES = {
    "f8": "F64", "f4": "F32", "f2": "F16", "i8": "I64", "i4": "I32", "i2": "I16", "i1": "I8",
    "u8": "U64", "u4": "U32", "u2": "U16", "u1": "U8", "b1": "BOOL",
}


@dataclass
class Memory:
    """A contiguous range of memory: its address, size, device ("host" or "cuda:N"), the object
    that owns it (kept alive while ferry uses the range) and, for tensors, dtype and shape."""

    addr: int
    size: int
    device: str
    owner: Any
    dtype: str | None = None
    shape: tuple[int, ...] | None = None


def is_torch_tensor(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def memory_of(obj: Any, device: str | None = None) -> Memory:
    """The memory of `obj`. InvalidArgument when it is not contiguous or has none ferry can use."""
    if is_torch_tensor(obj):
        if not obj.is_contiguous():
            raise InvalidArgument("a tensor must be contiguous (call .contiguous())")
        dev = obj.device
        where = f"cuda:{dev.index or 0}" if dev.type == "cuda" else "host"
        if dev.type not in ("cuda", "cpu"):
            raise InvalidArgument(f"tensors on {dev.type} are not supported: use cpu or cuda")
        dtype = _TORCH_DTYPES.get(str(obj.dtype).replace("torch.", ""))
        return Memory(obj.data_ptr(), obj.numel() * obj.element_size(), device or where, obj,
                      dtype, tuple(obj.shape))
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        if cai.get("strides") is not None:
            raise InvalidArgument("a CUDA array must be C-contiguous")
        itemsize = int(cai["typestr"][2:])
        count = 1
        for d in cai["shape"]:
            count *= d
        return Memory(cai["data"][0], count * itemsize, device or "cuda:0", obj,
                      _NUMPY_DTYPES.get(cai["typestr"][1:]), tuple(cai["shape"]))
    ai = getattr(obj, "__array_interface__", None)
    if ai is not None and hasattr(obj, "nbytes"):
        flags = getattr(obj, "flags", None)
        if flags is not None and not flags["C_CONTIGUOUS"]:
            raise InvalidArgument("an array must be C-contiguous (numpy.ascontiguousarray)")
        return Memory(ai["data"][0], int(obj.nbytes), device or "host", obj,
                      _NUMPY_DTYPES.get(ai["typestr"][1:]), tuple(ai["shape"]))
    if isinstance(obj, bytes):
        return Memory(ctypes.cast(ctypes.c_char_p(obj), ctypes.c_void_p).value or 0, len(obj),
                      device or "host", obj)
    try:
        view = memoryview(obj)
    except TypeError:
        raise InvalidArgument(f"{type(obj).__name__} has no memory ferry can use: give a buffer, "
                              "a numpy array or a torch tensor") from None
    if not view.contiguous:
        raise InvalidArgument("a buffer must be contiguous")
    if view.readonly:
        raise InvalidArgument("a read-only buffer cannot be registered (a pull may write it)")
    if view.nbytes == 0:
        raise InvalidArgument("an empty buffer")
    # The ctypes array holds the buffer export: a bytearray cannot be resized under ferry.
    arr = (ctypes.c_char * view.nbytes).from_buffer(view.cast("B"))
    return Memory(ctypes.addressof(arr), view.nbytes, device or "host", (obj, view, arr))
