"""Scaling NumPy half-precision buffers multiplies in float32 with the factor unrounded, as torch and Horovod do."""

from __future__ import annotations

import numpy as np

from hora.core.buffers.numpy_ops import NUMPY


def test_float16_scaling_does_not_round_the_factor_first():
    x = np.random.RandomState(1234).uniform(-100, 100, size=1000).astype(np.float16)
    factor = 0.1915194503788923  # NumPy alone would round it to float16 (0.1915) before multiplying
    want = (x.astype(np.float32) * np.float32(factor)).astype(np.float16)
    assert (x * factor != want).any(), "the example no longer tells the two roundings apart"
    got = x.copy()
    NUMPY.scale_(got, factor)
    np.testing.assert_array_equal(got, want)
    out = np.empty_like(x)
    NUMPY.scaled_copy_(out, x, factor)
    np.testing.assert_array_equal(out, want)


def test_integer_scaling_truncates_in_float64():
    x = np.array([7, -7, 100], np.int32)
    NUMPY.scale_(x, 0.5)
    assert x.tolist() == [3, -3, 50]
