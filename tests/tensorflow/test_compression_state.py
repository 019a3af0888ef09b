"""Where TensorFlow and Keras 3 keep a stateful compressor's state, in one process (the jobs test it across ranks).

A loaded state that no step has used yet is part of ``state_dict()``, so one
process can check that ``model.save``/``hvd.load_model``, ``tf.train.Checkpoint``
and ``hvd.CompressionState`` carry it.
"""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
pytestmark = pytest.mark.timeout(300)

Q = np.arange(8, dtype=np.float32).reshape(2, 4)


@pytest.fixture
def hvd():
    if keras.backend.backend() != "tensorflow":
        pytest.skip("these checks run Keras 3 on its TensorFlow backend")
    import hora.keras as hvd

    hvd.init()
    yield hvd
    hvd.shutdown()


def _seeded(compression) -> None:
    compression.load_state_dict({"step": 5, "rank": 0, "size": 1, "tensors": {"0.dense/kernel": {"q": Q}}})


def _model(hvd, compression):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=compression), loss="mse")
    return model


def _assert_seeded(state) -> None:
    assert state["step"] == 5
    np.testing.assert_array_equal(state["tensors"]["0.dense/kernel"]["q"], Q)


def test_model_save_and_load_model_carry_the_state(hvd, tmp_path):
    compression = hvd.Compression.powersgd(rank=2)
    model = _model(hvd, compression)
    _seeded(compression)
    model.save(tmp_path / "m.keras")
    loaded = hvd.load_model(tmp_path / "m.keras", compression=hvd.Compression.powersgd(rank=2))
    _assert_seeded(loaded.optimizer.compression_state_dict())
    plain = keras.models.load_model(tmp_path / "m.keras")  # a Keras without hora's classes still loads the model
    assert plain.optimizer is not None


def test_a_tf_checkpoint_of_the_optimizer_carries_the_state(hvd, tmp_path):
    compression = hvd.Compression.powersgd(rank=2)
    _seeded(compression)
    path = tf.train.Checkpoint(optimizer=_model(hvd, compression).optimizer).write(str(tmp_path / "ckpt"))
    fresh = hvd.Compression.powersgd(rank=2)
    tf.train.Checkpoint(optimizer=_model(hvd, fresh).optimizer).read(path).expect_partial()
    _assert_seeded(fresh.state_dict())


def test_compression_state_puts_a_tapes_compressor_in_a_checkpoint(hvd, tmp_path):
    import hora.tensorflow as htf

    compression = htf.Compression.powersgd(rank=2)
    _seeded(compression)
    path = tf.train.Checkpoint(compression=htf.CompressionState(compression)).write(str(tmp_path / "ckpt"))
    fresh = htf.Compression.powersgd(rank=2)
    tf.train.Checkpoint(compression=htf.CompressionState(fresh)).read(path).assert_consumed()
    _assert_seeded(fresh.state_dict())
