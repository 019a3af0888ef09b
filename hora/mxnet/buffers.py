"""MXNet NDArrays as engine buffers: zero-copy NumPy views of host memory, and results back as NDArrays.

MXNet runs its operators on its own asynchronous engine, so a view is taken
only after MXNet has finished with the array: ``wait_to_read`` before hora
reads an input, ``WaitToWrite`` (every pending reader and writer done)
before hora writes a result into it.  The binding's collectives block the
calling thread until the engine is done, so MXNet sees the new values in
every operator pushed afterwards.  Arrays that are not in host memory (GPU
contexts) are copied to and from the host instead.
"""

from __future__ import annotations

import ctypes
from typing import Any

import mxnet as mx
import numpy as np
from mxnet.base import _LIB, check_call

from hora.core.collectives import Adapter

#: dtypes every collective takes (those of ``horovod.mxnet``, plus bool).
SUPPORTED = ("uint8", "int8", "int32", "int64", "float16", "float32", "float64", "bool")

_HOST = ("cpu", "cpu_pinned", "cpu_shared")


def check_ndarray(tensor: Any, what: str) -> mx.nd.NDArray:
    """Refuse what no collective takes: non-NDArrays, sparse arrays and unsupported dtypes.

    Raises:
        TypeError: not a dense NDArray of a supported dtype; the message names the fix.
    """
    if not isinstance(tensor, mx.nd.NDArray):
        raise TypeError(f"{what} expects an mx.nd.NDArray, got {type(tensor).__name__}")
    if tensor.stype != "default":
        raise TypeError(f"{what} of a {tensor.stype} NDArray: call .tostype('default') first")
    name = np.dtype(tensor.dtype).name
    if name not in SUPPORTED:
        raise TypeError(f"{what} does not support dtype {name}; supported: {', '.join(SUPPORTED)}")
    return tensor


def on_host(tensor: mx.nd.NDArray) -> bool:
    """True when the array lives in host memory, where hora can view it without a copy."""
    return tensor.context.device_type in _HOST


def _view(tensor: mx.nd.NDArray) -> np.ndarray:
    dtype = np.dtype(tensor.dtype)
    shape = tuple(tensor.shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes == 0:
        return np.empty(shape, dtype)
    ptr = ctypes.c_void_p()
    check_call(_LIB.MXNDArrayGetData(tensor.handle, ctypes.byref(ptr)))
    raw = (ctypes.c_char * nbytes).from_address(ptr.value)
    raw.owner = tensor  # the view keeps the NDArray (and so its memory) alive
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def engine_view(tensor: mx.nd.NDArray) -> np.ndarray:
    """A NumPy view of a host array without waiting on MXNet: only inside an engine operation that lists
    the array (:mod:`hora.mxnet.engine`), where MXNet has already finished what came before."""
    return _view(tensor)


def read_view(tensor: mx.nd.NDArray) -> np.ndarray:
    """The array's values as a NumPy array, once MXNet has finished writing them (zero-copy on the host)."""
    if not on_host(tensor):
        return tensor.asnumpy()
    tensor.wait_to_read()
    return _view(tensor)


def write_view(tensor: mx.nd.NDArray) -> np.ndarray:
    """A writable NumPy view of a host array, once every pending MXNet operator on it has finished."""
    check_call(_LIB.MXNDArrayWaitToWrite(tensor.handle))
    return _view(tensor)


def to_ndarray(array: np.ndarray, ctx: mx.Context | None = None) -> mx.nd.NDArray:
    """An engine result as an NDArray: the NumPy array's memory is handed over when it can be."""
    array = np.asarray(array)
    if ctx is None or ctx.device_type in _HOST:
        if array.flags.c_contiguous and array.flags.writeable and array.dtype.name != "bool" and array.size:
            try:
                return mx.nd.from_numpy(array, zero_copy=True)
            except (ValueError, mx.base.MXNetError):
                pass  # memory MXNet cannot adopt (e.g. a view into a larger buffer): copy it
        return mx.nd.array(array, dtype=array.dtype)
    return mx.nd.array(array, ctx=ctx, dtype=array.dtype)


def copy_into(dst: mx.nd.NDArray, src: np.ndarray) -> None:
    """Write a host result into an NDArray that could not be viewed (a GPU array)."""
    dst[:] = mx.nd.array(src, ctx=dst.context, dtype=dst.dtype)


#: inputs read through views, results made into new NDArrays.
READ = Adapter(to_buffer=read_view, from_buffer=to_ndarray)
#: in-place collectives: the engine writes into views of the NDArrays themselves.
WRITE = Adapter(to_buffer=write_view)
#: arrays that cannot be viewed (GPU): read through host copies, results left as NumPy arrays for copy_into.
COPY = Adapter(to_buffer=read_view)
