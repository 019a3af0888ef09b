"""The engine's array families: what the NumPy family does must match the torch family, and
anything on the host with DLPack or the buffer protocol must reach the engine without a copy."""

from __future__ import annotations

import array

import numpy as np
import pytest

from hora.core.buffers import as_buffer, ops_for
from hora.core.buffers.numpy_ops import NUMPY

torch = pytest.importorskip("torch")
from hora.core.buffers.torch_ops import TORCH  # noqa: E402


class DLPackOnly:
    """An object that offers its memory only through DLPack, as other frameworks' tensors do."""

    def __init__(self, a: np.ndarray) -> None:
        self._a = a

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_dlpack_and_buffer_protocol_are_viewed_not_copied():
    base = np.arange(6, dtype=np.float32)
    viewed = as_buffer(DLPackOnly(base))
    assert isinstance(viewed, np.ndarray) and np.shares_memory(viewed, base)
    raw = array.array("d", [1.0, 2.0, 3.0])
    view = as_buffer(raw)
    view[0] = 7.0  # a write through the engine's view lands in the caller's memory
    assert raw[0] == 7.0
    assert as_buffer(base) is base


def test_unknown_types_get_a_clear_error():
    with pytest.raises(TypeError, match="NumPy arrays or torch tensors"):
        ops_for([1, 2, 3])


def test_families_are_found_by_type():
    assert ops_for(np.ones(2)) is NUMPY
    assert ops_for(torch.ones(2)) is TORCH
    assert ops_for(torch.nn.Parameter(torch.ones(2))) is TORCH


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64", "int8", "uint8", "float16"])
def test_numpy_and_torch_families_agree(dtype):
    rng = np.random.default_rng(0)
    pieces = [(rng.standard_normal(n) * 50).astype(dtype) for n in (3, 1, 7)]
    results = []
    for ops, wrap in ((NUMPY, lambda a: a.copy()), (TORCH, torch.from_numpy)):
        sources = [wrap(p) for p in pieces]
        buf = ops.empty((11,), dtype, ops.device(sources[0]))
        ops.pack(sources, buf)
        ops.scale_(buf, 0.37)  # integers truncate toward zero, as Horovod does
        outs = [ops.empty_like(s) for s in sources]
        ops.unpack(buf, outs)
        results.append([np.asarray(o) for o in outs])
        assert ops.dtype_name(sources[0]) == dtype
    for a, b in zip(*results, strict=True):
        np.testing.assert_array_equal(a, b)


def test_cast_flat_copy_never_aliases_and_upcasts():
    a = np.arange(4, dtype=np.float32)
    same = NUMPY.cast_flat(a, "float32")
    assert np.shares_memory(same, a)
    copied = NUMPY.cast_flat(a, "float32", copy=True)
    assert not np.shares_memory(copied, a)
    up = NUMPY.cast_flat(np.ones((2, 2), np.float16), "float32")
    assert up.dtype == np.float32 and up.shape == (4,)


def test_scaled_copy_and_bool_as_bytes():
    src = np.array([1.0, -2.0, 3.0], np.float32)
    dst = np.empty_like(src)
    NUMPY.scaled_copy_(dst, src, 0.5)
    assert dst.tolist() == [0.5, -1.0, 1.5]
    flags = np.array([True, False, True])
    assert NUMPY.as_bytes(flags).tolist() == [1, 0, 1]
    ints = np.array([7, -7], np.int64)
    NUMPY.scale_(ints, 0.5)
    assert ints.tolist() == [3, -3]
