"""The ``torch`` array family: torch tensors on the CPU or a GPU, reduced in their own memory.

Loaded only when a torch tensor reaches the engine (or a torch.distributed
backend starts), so a job that never imports torch never loads this module.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from hora.core.buffers import Array, ArrayOps


@functools.cache
def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a dtype name."""
    return getattr(torch, name)


_NAMES: dict[torch.dtype, str] = {}


def _name(dtype: torch.dtype) -> str:
    name = _NAMES.get(dtype)
    if name is None:
        name = _NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


class TorchOps(ArrayOps):
    """:class:`~hora.core.buffers.ArrayOps` on torch tensors (CPU and CUDA)."""

    family = "torch"

    def dtype_name(self, a: Array) -> str:
        return _name(a.dtype)

    def shape(self, a: Array) -> tuple[int, ...]:
        return tuple(a.shape)

    def device(self, a: Array) -> torch.device:
        return a.device

    def device_type(self, a: Array) -> str:
        return "cpu" if a.is_cpu else a.device.type  # is_cpu: no torch.device object built per call

    def numel(self, a: Array) -> int:
        return a.numel()

    def is_contiguous(self, a: Array) -> bool:
        return a.is_contiguous()

    def same_memory(self, a: Array, b: Array) -> bool:
        return a.data_ptr() == b.data_ptr()

    def empty(self, shape: Sequence[int], dtype: str, device: str) -> Array:
        return torch.empty(tuple(shape), dtype=torch_dtype(dtype), device=device)

    def zeros(self, shape: Sequence[int], dtype: str, device: str) -> Array:
        return torch.zeros(tuple(shape), dtype=torch_dtype(dtype), device=device)

    def empty_like(self, a: Array) -> Array:
        return torch.empty_like(a, memory_format=torch.contiguous_format)

    def clone(self, a: Array) -> Array:
        return a.clone(memory_format=torch.contiguous_format)

    def contiguous(self, a: Array) -> Array:
        return a.contiguous()

    def int32_vector(self, values: Sequence[int], device: str = "cpu") -> Array:
        return torch.tensor(list(values), dtype=torch.int32)

    def flat(self, a: Array) -> Array:
        return a.view(-1)

    def as_bytes(self, a: Array) -> Array:
        flat = a.reshape(-1)
        return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=a.device)

    def reshape(self, a: Array, shape: Sequence[int]) -> Array:
        return a.view(tuple(shape)) if a.is_contiguous() else a.reshape(tuple(shape))

    def astype(self, a: Array, dtype: str) -> Array:
        return a.to(torch_dtype(dtype))

    def cast_flat(self, a: Array, dtype: str, copy: bool = False) -> Array:
        work = a.to(torch_dtype(dtype)).contiguous().view(-1)
        if copy and work.data_ptr() == a.data_ptr():
            work = work.clone()
        return work

    def copy_(self, dst: Array, src: Array) -> None:
        dst.copy_(src.view(dst.shape) if src.is_contiguous() else src.reshape(dst.shape))

    def scale_(self, a: Array, factor: float) -> None:
        if factor == 1.0:
            return
        if a.is_floating_point():
            a.mul_(factor)
        else:
            a.copy_(torch.trunc(a.to(torch.float64) * factor))

    def scaled_copy_(self, dst: Array, src: Array, factor: float) -> None:
        if factor != 1.0 and src.is_floating_point():
            torch.mul(src, factor, out=dst)
        else:
            dst.copy_(src)
            self.scale_(dst, factor)

    def pack(self, sources: Sequence[Array], out: Array) -> None:
        # One torch call: a slice-and-copy per tensor costs ~25 us of Python each.
        torch.cat([s.reshape(-1) for s in sources], out=out)

    def unpack(self, buf: Array, outputs: Sequence[Array]) -> None:
        pieces = torch.split_with_sizes(buf, [o.numel() for o in outputs])
        if all(o.is_contiguous() for o in outputs):
            torch._foreach_copy_([o.view(-1) for o in outputs], pieces)
        else:
            for o, piece in zip(outputs, pieces, strict=True):
                o.copy_(piece.view(o.shape))

    def stack_(self, sources: Sequence[Array], out: Array, accumulate: bool = False) -> None:
        shape = out.shape[1:]
        views = list(out.unbind(0))
        flat = [s.view(shape) if s.is_contiguous() else s.reshape(shape) for s in sources]
        # One foreach call for the whole stack: a copy per tensor costs ~10 us of Python each.
        if accumulate:
            torch._foreach_add_(views, flat)
        else:
            torch._foreach_copy_(views, flat)

    def unstack_(self, stack: Array, outputs: Sequence[Array], factor: float = 1.0) -> None:
        if factor != 1.0:
            stack.mul_(factor)  # the stack is the compressor's scratch: scaling it in place saves a copy
        pieces = list(stack.unbind(0))
        if all(o.is_contiguous() for o in outputs):
            torch._foreach_copy_([o.view(p.shape) for o, p in zip(outputs, pieces, strict=True)], pieces)
        else:
            for o, piece in zip(outputs, pieces, strict=True):
                o.copy_(piece.reshape(o.shape))

    def matmul_(self, a: Array, b: Array, out: Array, transpose_a: bool = False, transpose_b: bool = False) -> None:
        torch.matmul(a.transpose(-1, -2) if transpose_a else a, b.transpose(-1, -2) if transpose_b else b, out=out)

    def orthonormalize_(self, a: Array) -> None:
        q, _ = torch.linalg.qr(a, mode="reduced")
        a.copy_(q)

    def add_(self, dst: Array, src: Array, alpha: float = 1.0) -> None:
        src = src.view(dst.shape) if src.is_contiguous() else src.reshape(dst.shape)
        if src.dtype != dst.dtype:
            src = src.to(dst.dtype)
        dst.add_(src, alpha=alpha)

    def random_normal(self, shape: Sequence[int], dtype: str, device: torch.device, seed: int) -> Array:
        g = torch.Generator().manual_seed(seed)  # on the CPU, so every device type draws the same values
        return torch.randn(tuple(shape), generator=g, dtype=torch_dtype(dtype)).to(device)


def wait_for_stream(tensors: Sequence[torch.Tensor]) -> None:
    """Let the current CUDA stream finish writing ``tensors`` before the engine's thread reads them."""
    first = tensors[0]
    if first.is_cuda:
        torch.cuda.current_stream(first.device).synchronize()


def host_numpy(a: Array) -> np.ndarray:
    """A NumPy view of a CPU tensor (bfloat16 viewed as int16 bits)."""
    if a.dtype == torch.bfloat16:
        return a.view(torch.int16).numpy()
    return a.numpy()


def from_numpy(a: np.ndarray) -> torch.Tensor:
    """A CPU tensor sharing ``a``'s memory (ml_dtypes' bfloat16 becomes torch.bfloat16)."""
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


TORCH = TorchOps()
