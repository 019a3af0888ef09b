"""hora.kvstore.compression: MXNet's 2-bit rule, bit layout and error feedback, on known inputs."""

from __future__ import annotations

import numpy as np
import pytest

from hora.errors import ConfigError
from hora.kvstore.compression import TwoBitCompressor, create_compressor, decompressor_from_spec

f32 = np.float32


def _mxnet_quantize_2bit(grad: np.ndarray, residual: np.ndarray, t: float) -> np.ndarray:
    """MXNet's quantize_2bit kernel transcribed element by element: bytes of each float32 block,
    masks 0xc0/0x30/0x0c/0x03 for +t and 0x80/0x20/0x08/0x02 for -t."""
    posbits, negbits = [0xC0, 0x30, 0x0C, 0x03], [0x80, 0x20, 0x08, 0x02]
    n = grad.size
    out = bytearray(4 * ((n + 15) // 16))
    t = f32(t)
    for i in range(n):
        residual[i] = f32(residual[i] + grad[i])
        if residual[i] >= t:
            out[i >> 2] |= posbits[i & 3]
            residual[i] = f32(residual[i] - t)
        elif residual[i] <= -t:
            out[i >> 2] |= negbits[i & 3]
            residual[i] = f32(residual[i] + t)
    return np.frombuffer(bytes(out), dtype="<u4")


def test_known_block_and_words():
    """Two words by hand: codes 11=+t, 10=-t, 00=0, value j in byte j//4, high bit pair first."""
    c = TwoBitCompressor(0.5)
    g = np.array([0.6, -0.7, 0.1, 0.5,  -0.5, 0.0, 1.2, -0.2,  0.3, 0.4, 0.5, 0.6,  -1, -1, 1, 1,  0.9], f32)
    words = c.compress("w", g)
    # bytes: 11 10 00 11 = 0xE3 | 10 00 11 00 = 0x8C | 00 00 11 11 = 0x0F | 10 10 11 11 = 0xAF ; then 11 000000
    assert words.dtype == np.uint32 and words.tolist() == [0xAF0F8CE3, 0x000000C0]
    expected_residual = g - np.array([.5, -.5, 0, .5, -.5, 0, .5, 0, 0, 0, .5, .5, -.5, -.5, .5, .5, .5], f32)
    np.testing.assert_allclose(c.residual("w"), expected_residual, atol=1e-7)
    np.testing.assert_array_equal(
        c.decompress(words, g.size),
        np.array([.5, -.5, 0, .5, -.5, 0, .5, 0, 0, 0, .5, .5, -.5, -.5, .5, .5, .5], f32))


def test_residual_carries_over_between_calls():
    c = TwoBitCompressor(0.5)
    g = np.array([0.3, -0.3, 0.2, 0.9], f32)
    first = c.decompress(c.compress("k", g), 4)
    np.testing.assert_array_equal(first, [0, 0, 0, 0.5])
    np.testing.assert_allclose(c.residual("k"), [0.3, -0.3, 0.2, 0.4], atol=1e-7)
    second = c.decompress(c.compress("k", g), 4)
    np.testing.assert_array_equal(second, [0.5, -0.5, 0, 0.5])  # 0.6, -0.6, 0.4, 1.3
    np.testing.assert_allclose(c.residual("k"), [0.1, -0.1, 0.4, 0.8], atol=1e-6)
    c.reset("k")
    assert c.residual("k") is None


@pytest.mark.parametrize("n", [1, 15, 16, 17, 33, 100])
def test_matches_transcribed_kernel_over_several_calls(n):
    rng = np.random.default_rng(n)
    c = TwoBitCompressor(0.4)
    residual = np.zeros(n, f32)
    for step in range(4):
        g = (rng.standard_normal(n) * 0.5).astype(f32)
        words = c.compress("k", g)
        expected = _mxnet_quantize_2bit(g, residual, 0.4)
        assert words.size == (n + 15) // 16 == c.compressed_size(n)
        np.testing.assert_array_equal(words, expected, err_msg=f"step {step}")
        np.testing.assert_array_equal(c.residual("k"), residual)
        decoded = c.decompress(words, n)
        assert decoded.dtype == np.float32 and decoded.shape == (n,)
        assert set(np.unique(decoded)) <= {f32(-0.4), f32(0), f32(0.4)}


def test_error_feedback_conserves_the_gradient_sum():
    """Everything pushed so far plus the residual equals everything the gradients added."""
    rng = np.random.default_rng(0)
    c = TwoBitCompressor(0.25)
    sent = np.zeros((4, 5), np.float64)
    total = np.zeros((4, 5), np.float64)
    for _ in range(20):
        g = (rng.standard_normal((4, 5)) * 0.3).astype(f32)
        total += g
        sent += c.decompress(c.compress("k", g), 20).reshape(4, 5)
    np.testing.assert_allclose(sent + c.residual("k").reshape(4, 5), total, atol=1e-5)


def test_other_dtypes_are_quantised_in_float32_and_empty_keys_work():
    c = TwoBitCompressor(1.0)
    words = c.compress("d", np.array([2.0, -2.0], np.float64))
    np.testing.assert_array_equal(c.decompress(words, 2), [1.0, -1.0])
    assert c.residual("d").dtype == np.float32
    empty = c.compress("e", np.zeros(0, f32))
    assert empty.size == 0 and c.decompress(empty, 0).size == 0


def test_errors():
    c = TwoBitCompressor(0.5)
    c.compress("k", np.zeros(5, f32))
    with pytest.raises(ConfigError, match="5 values before and 6 now"):
        c.compress("k", np.zeros(6, f32))
    with pytest.raises(ConfigError, match="need 2 words"):
        c.decompress(np.zeros(1, np.uint32), 17)


@pytest.mark.parametrize("threshold", [0, -0.5, float("nan"), float("inf"), "0.5", True])
def test_bad_threshold(threshold):
    with pytest.raises(ConfigError, match="threshold"):
        create_compressor({"type": "2bit", "threshold": threshold})


def test_create_compressor_params():
    assert create_compressor({"type": "none"}) is None
    assert create_compressor(None) is None
    assert create_compressor({"type": "2bit"}).threshold == 0.5  # MXNet's default
    with pytest.raises(ConfigError, match="valid types are: none, 2bit"):
        create_compressor({"type": "1bit"})
    with pytest.raises(ConfigError, match="thresold"):
        create_compressor({"type": "2bit", "thresold": 0.5})
    with pytest.raises(ConfigError, match="dict"):
        create_compressor("2bit")


def test_spec_round_trip_decodes_on_the_receiving_side():
    c = TwoBitCompressor(0.75)
    words = c.compress("k", np.array([1.0, -1.0, 0.1], f32))
    decoder = decompressor_from_spec(c.spec())
    assert c.spec() == {"type": "2bit", "threshold": 0.75}
    np.testing.assert_array_equal(decoder.decompress(words, 3), [0.75, -0.75, 0.0])
    assert decompressor_from_spec({"type": "none"}) is None
