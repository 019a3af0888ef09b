"""The few array operations the stores need, on NumPy arrays and torch tensors alike.

torch is imported only when a tensor is actually handed in, so a store used
with NumPy arrays alone works without torch installed.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import Any

import numpy as np

Array = Any  # numpy.ndarray | torch.Tensor


def is_numpy(x: Any) -> bool:
    """True for a NumPy array."""
    return isinstance(x, np.ndarray)


def shape_of(x: Array) -> tuple[int, ...]:
    """The shape as a tuple of ints."""
    return tuple(int(s) for s in x.shape)


def device_of(x: Array) -> str:
    """``cpu`` for NumPy arrays, else the tensor's device (``cpu``, ``cuda:0`` ...)."""
    return "cpu" if is_numpy(x) else str(x.device)


def dtype_name(x: Array) -> str:
    """The dtype as a short name (``float32``) for messages."""
    return str(x.dtype).removeprefix("torch.")


def numpy_of(x: Array) -> np.ndarray:
    """A NumPy view of a CPU array or tensor (zero-copy), or a host copy of a device tensor."""
    if is_numpy(x):
        return x
    x = x.detach()
    if str(x.dtype) == "torch.bfloat16":
        x = x.float()
    return x.cpu().numpy()


def torch_of(x: Array) -> Any:
    """A tensor sharing memory with a NumPy array (zero-copy), or the tensor itself."""
    if is_numpy(x):
        import torch

        return torch.from_numpy(np.ascontiguousarray(x))
    return x.detach()


def copy_of(x: Array, like: Array | None = None, device: str | None = None) -> Array:
    """A fresh copy of ``x``, converted to the kind, dtype and device of ``like`` (when given)
    or moved to ``device`` (tensors only)."""
    if like is None:
        if is_numpy(x):
            return np.array(x, copy=True)
        return x.detach().to(device or x.device, copy=True)
    if is_numpy(like):
        return np.array(numpy_of(x), dtype=like.dtype, copy=True)
    import torch

    src = torch.from_numpy(np.ascontiguousarray(x)) if is_numpy(x) else x.detach()
    return src.to(device=device or like.device, dtype=like.dtype, copy=True)


def converted(x: Array, like: Array) -> Array:
    """``x`` as the kind, dtype and device of ``like``; no copy when it already matches."""
    if is_numpy(like):
        a = numpy_of(x)
        return a if a.dtype == like.dtype else a.astype(like.dtype)
    import torch

    src = torch.from_numpy(np.ascontiguousarray(x)) if is_numpy(x) else x.detach()
    return src.to(device=like.device, dtype=like.dtype)


def copy_into(dst: Array, src: Array) -> None:
    """Copy ``src`` into ``dst`` in place (any kinds, devices and dtypes; same shape)."""
    if is_numpy(dst):
        np.copyto(dst, numpy_of(src), casting="unsafe")
    elif is_numpy(src):
        import torch

        dst.copy_(torch.from_numpy(np.ascontiguousarray(src)))
    else:
        dst.copy_(src.detach())


def add_into(acc: Array, x: Array) -> None:
    """``acc += x`` with ``x`` first converted to ``acc``'s kind, dtype and device."""
    acc += converted(x, acc)


_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def math_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The process's threads for array arithmetic cut into pieces (NumPy releases the GIL): a server's
    sums and its optimizers' updates.  A task running on it must not wait for others on it."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2,
                                                          thread_name_prefix="hora-math")
        return _pool


__all__ = ["math_pool", "is_numpy", "shape_of", "device_of", "dtype_name", "numpy_of", "torch_of", "copy_of",
           "converted", "copy_into", "add_into"]
