"""Stateful compression through the Keras DistributedOptimizer of the job's flavour: Keras 3 (TF, torch), tf_keras."""

from __future__ import annotations

import os

import numpy as np
import pytest

FLAVOUR = os.environ.get("HORA_TEST_KERAS", "keras3")
if FLAVOUR == "tfkeras":
    import tensorflow as tf

    import hora.tensorflow.keras as hvd

    keras = tf.keras
else:
    import keras

    import hora.keras as hvd


def _model():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((10,)), keras.layers.Dense(24, activation="tanh"),
                             keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)])


def _train(compression, steps: int = 4, **kwargs):
    model = _model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=compression, **kwargs),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    for s in range(steps):
        rng = np.random.default_rng(100 * s + hvd.rank())
        model.train_on_batch(rng.normal(size=(8, 10)).astype("float32"), rng.integers(0, 3, 8).astype("int32"))
    return model.get_weights()


def test_powersgd_leaves_identical_weights_on_every_rank():
    weights = _train(hvd.Compression.powersgd(rank=1, min_compression_rate=0))
    for i, w in enumerate(weights):
        gathered = hvd.allgather_object(w)
        for r, other in enumerate(gathered):
            np.testing.assert_array_equal(other, gathered[0], err_msg=f"weight {i} differs on rank {r}")
    plain = _train(hvd.Compression.none)
    assert any(np.abs(a - b).max() > 1e-6 for a, b in zip(weights, plain, strict=True))


@pytest.mark.parametrize("op", ["average", "sum"])
def test_full_rank_powersgd_equals_plain_allreduce(op):
    kwargs = {"op": hvd.Sum} if op == "sum" else {}
    compressed = _train(hvd.Compression.powersgd(rank=64, min_compression_rate=0), **kwargs)
    plain = _train(hvd.Compression.none, **kwargs)
    for a, b in zip(compressed, plain, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_error_feedback_trains_identically_on_every_rank():
    weights = _train(hvd.Compression.fp16.with_error_feedback())
    for w in weights:
        gathered = hvd.allgather_object(w)
        assert all(np.array_equal(g, gathered[0]) for g in gathered)
