"""The 16-bit float reduction kernels of the MPI backend, against torch's float32 -> 16-bit rounding (no MPI)."""

from __future__ import annotations

import numpy as np
import pytest

from hora.core.buffers.half import HalfReducer, bf16_to_f32, f16_to_f32, f32_to_bf16
from hora.core.ops import ReduceOp

torch = pytest.importorskip("torch")

TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16}
REF = {ReduceOp.SUM: torch.add, ReduceOp.PRODUCT: torch.mul, ReduceOp.MIN: torch.minimum,
       ReduceOp.MAX: torch.maximum}


def words(values, dtype: str) -> np.ndarray:
    """16-bit words of ``values`` rounded to ``dtype`` by torch."""
    return torch.tensor(np.asarray(values, np.float32)).to(TORCH[dtype]).view(torch.int16).numpy().view(np.uint16)


def reference(a: np.ndarray, b: np.ndarray, dtype: str, op: ReduceOp) -> np.ndarray:
    """Widen both to float32, combine, round to ``dtype`` to nearest even: torch's casts do each step."""
    ta = torch.from_numpy(a.view(np.int16).copy()).view(TORCH[dtype]).float()
    tb = torch.from_numpy(b.view(np.int16).copy()).view(TORCH[dtype]).float()
    return REF[op](tb, ta).to(TORCH[dtype]).view(torch.int16).numpy().view(np.uint16)


def reduce(a: np.ndarray, b: np.ndarray, dtype: str, op: ReduceOp, reducer: HalfReducer | None = None) -> np.ndarray:
    out = b.copy()
    (reducer or HalfReducer()).reduce(dtype, op, a, out)
    return out


def same_bits_or_nan(got: np.ndarray, want: np.ndarray, dtype: str) -> None:
    """Equal bit patterns, except that any NaN matches any NaN (payloads may differ)."""
    g = torch.from_numpy(got.view(np.int16).copy()).view(TORCH[dtype]).float().numpy()
    w = torch.from_numpy(want.view(np.int16).copy()).view(TORCH[dtype]).float().numpy()
    assert np.array_equal(np.isnan(g), np.isnan(w))
    keep = ~np.isnan(w)
    np.testing.assert_array_equal(got[keep], want[keep])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("op", list(REF))
def test_random_values_match_float32_then_round(dtype, op):
    rng = np.random.default_rng(7)
    n = 100_003
    scale = rng.choice([1e-6, 1e-2, 1.0, 100.0, 3e4], size=n).astype(np.float32)
    a = words(rng.standard_normal(n).astype(np.float32) * scale, dtype)
    b = words(rng.standard_normal(n).astype(np.float32) * scale, dtype)
    reducer = HalfReducer()
    got = reduce(a, b, dtype, op, reducer)
    same_bits_or_nan(got, reference(a, b, dtype, op), dtype)
    # A shorter segment reuses the grown scratch and is still right.
    short = reduce(a[:17], b[:17], dtype, op, reducer)
    np.testing.assert_array_equal(short, got[:17])


@pytest.mark.parametrize(("dtype", "a", "b", "want"), [
    # ties round to the even neighbour
    ("float16", 1.0, 2.0 ** -11, 1.0),
    ("float16", 1.0 + 2.0 ** -10, 2.0 ** -11, 1.0 + 2.0 ** -9),
    ("bfloat16", 1.0, 2.0 ** -8, 1.0),
    ("bfloat16", 1.0 + 2.0 ** -7, 2.0 ** -8, 1.0 + 2.0 ** -6),
    # just past a tie rounds up
    ("bfloat16", 1.0, 2.0 ** -8 + 2.0 ** -15, 1.0 + 2.0 ** -7),
    # overflow to infinity, infinities, NaN from inf - inf
    ("float16", 65504.0, 65504.0, np.inf),
    ("bfloat16", 3.3895314e38, 3.3895314e38, np.inf),
    ("float16", np.inf, 1.0, np.inf),
    ("bfloat16", -np.inf, 1.0, -np.inf),
    ("float16", np.inf, -np.inf, np.nan),
    ("bfloat16", np.inf, -np.inf, np.nan),
    # subnormals add exactly
    ("float16", 2.0 ** -24, 2.0 ** -24, 2.0 ** -23),
    ("bfloat16", 2.0 ** -133, 2.0 ** -133, 2.0 ** -132),
    ("bfloat16", -(2.0 ** -133), 2.0 ** -133, 0.0),
])
def test_sum_edge_cases(dtype, a, b, want):
    got = reduce(words([a], dtype), words([b], dtype), dtype, ReduceOp.SUM)
    value = torch.from_numpy(got.view(np.int16).copy()).view(TORCH[dtype]).float().item()
    if np.isnan(want):
        assert np.isnan(value)
    else:
        assert value == want


@pytest.mark.parametrize("nan_word", [0x7F81, 0x7FC0, 0xFFFF, 0xFF81])
def test_bfloat16_nan_stays_nan(nan_word):
    """A NaN whose payload sits in the low bits must not round into an infinity (or wrap to zero)."""
    a = np.array([nan_word, nan_word], np.uint16)
    b = words([1.0, -2.0], "bfloat16")
    got = reduce(a, b, "bfloat16", ReduceOp.SUM)
    assert np.isnan(bf16_to_f32(got)).all()


def test_bfloat16_round_trip_is_exact():
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    out = np.empty_like(every)
    f32_to_bf16(bf16_to_f32(every).copy(), out)
    finite = ~np.isnan(bf16_to_f32(every))
    np.testing.assert_array_equal(out[finite], every[finite])
    assert np.isnan(bf16_to_f32(out[~finite])).all()


def test_f16_to_f32_is_numpys_cast_on_every_bit_pattern():
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    want = every.view(np.float16).astype(np.float32)
    np.testing.assert_array_equal(f16_to_f32(every).view(np.uint32), want.view(np.uint32))


def test_f32_to_bf16_matches_torch_on_all_rounding_cases():
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 1 << 32, size=200_000, dtype=np.uint64).astype(np.uint32)
    values = bits.view(np.float32)
    out = np.empty(values.size, np.uint16)
    f32_to_bf16(values.copy(), out)
    want = torch.from_numpy(values.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    same_bits_or_nan(out, want, "bfloat16")


def test_unknown_dtype_and_op_are_refused():
    a = np.zeros(4, np.uint16)
    with pytest.raises(ValueError, match="int16"):
        HalfReducer().reduce("int16", ReduceOp.SUM, a, a.copy())
    with pytest.raises(KeyError):
        HalfReducer().reduce("float16", ReduceOp.AVERAGE, a, a.copy())
