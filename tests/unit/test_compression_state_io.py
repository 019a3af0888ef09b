"""Saving a stateful compressor's state for the TensorFlow and Keras bindings: bytes without pickle, stable names."""

from __future__ import annotations

import numpy as np
import pytest

from hora._keras.compression_state import (
    read_dir,
    save_to_dir,
    split_compressors,
    state_from_bytes,
    state_name,
    state_to_bytes,
)
from hora.core.compression import Compression


def _state(make=np.asarray):
    return {"step": 7, "rank": 1, "size": 3, "settings": {"kind": "powersgd", "rank": 2},
            "tensors": {"0.dense/kernel": {"q": make(np.arange(6, dtype=np.float32).reshape(2, 3)),
                                           "residual": make(np.ones((4, 3), np.float64))},
                        "2.dense_1/kernel": {"q": make(np.zeros((2, 5), np.float32))}}}


def test_state_round_trips_through_bytes_without_pickle():
    back = state_from_bytes(state_to_bytes(_state()))
    assert {k: v for k, v in back.items() if k != "tensors"} == {"step": 7, "rank": 1, "size": 3,
                                                                  "settings": {"kind": "powersgd", "rank": 2}}
    want = _state()["tensors"]
    assert back["tensors"].keys() == want.keys()
    for name, arrays in want.items():
        assert back["tensors"][name].keys() == arrays.keys()
        for key, a in arrays.items():
            assert back["tensors"][name][key].dtype == a.dtype
            np.testing.assert_array_equal(back["tensors"][name][key], a)


def test_torch_tensors_are_saved_as_numpy():
    torch = pytest.importorskip("torch")
    back = state_from_bytes(state_to_bytes(_state(torch.from_numpy)))
    np.testing.assert_array_equal(back["tensors"]["0.dense/kernel"]["q"], np.arange(6).reshape(2, 3))


def test_garbage_is_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="not a saved hora compression state"):
        state_from_bytes(b"not an npz")


def test_a_directory_holds_the_state_only_for_a_stateful_compressor(tmp_path):
    save_to_dir(Compression.fp16, str(tmp_path))
    assert read_dir(str(tmp_path)) is None
    compressor = Compression.powersgd(rank=2)
    compressor.step = 5
    save_to_dir(compressor, str(tmp_path))
    assert read_dir(str(tmp_path))["step"] == 5


def test_names_leave_out_the_model_scope_that_load_model_drops():
    class Var:
        def __init__(self, path):
            self.path = path

    assert state_name(0, Var("sequential/dense/kernel")) == state_name(0, Var("dense/kernel")) == "0.dense/kernel"
    assert state_name(3, Var("dense_1/bias")) == "3.dense_1/bias"
    assert state_name(2) == "grad.2"


def test_stateful_compressors_are_taken_out_of_elastic_attributes():
    compressor = Compression.fp16.with_error_feedback()
    kwargs = {"epoch": 0, "compression": compressor, "cast": Compression.fp16}
    assert split_compressors(kwargs) == {"compression": compressor}
    assert kwargs == {"epoch": 0, "cast": Compression.fp16}
