"""Stateful compression through hora.tensorflow's DistributedGradientTape and TF1 DistributedOptimizer."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import tensorflow as tf

import hora.tensorflow as hvd
from hora.errors import HoraError

MODES = ["eager", "function"]


def _model() -> list[tf.Variable]:
    rng = np.random.default_rng(5)
    shapes = [(12, 24), (24,), (24, 16), (16,), (16, 3)]
    return [tf.Variable(rng.standard_normal(s) * 0.3, dtype=tf.float64, name=f"v{i}") for i, s in enumerate(shapes)]


def _loss(vs: list[tf.Variable], x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
    h = tf.tanh(x @ vs[0] + vs[1])
    h = tf.tanh(h @ vs[2] + vs[3])
    return tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(y, h @ vs[4], from_logits=True))


def _batch(step: int) -> tuple[tf.Tensor, tf.Tensor]:
    rng = np.random.default_rng(1000 * step + hvd.rank())
    return tf.constant(rng.standard_normal((6, 12))), tf.constant(rng.integers(0, 3, 6))


def _train(compression, mode: str, steps: int = 4, start: int = 0, variables=None, **kwargs):
    vs = variables if variables is not None else _model()

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = _loss(vs, x, y)
        tape = hvd.DistributedGradientTape(tape, compression=compression, **kwargs)
        grads = tape.gradient(loss, vs)
        for v, g in zip(vs, grads, strict=True):
            v.assign_sub(0.1 * g)

    fn = tf.function(step) if mode == "function" else step
    for s in range(start, start + steps):
        fn(*_batch(s))
    return vs


def _same_on_every_rank(vs) -> None:
    for i, v in enumerate(vs):
        gathered = hvd.allgather(tf.expand_dims(v, 0), name=f"check.tf.{i}").numpy()
        for r in range(1, gathered.shape[0]):
            np.testing.assert_array_equal(gathered[r], gathered[0], err_msg=f"variable {i} differs on rank {r}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("make", [lambda: hvd.Compression.powersgd(rank=1, min_compression_rate=0),
                                  lambda: hvd.Compression.fp16.with_error_feedback(),
                                  lambda: hvd.Compression.bf16.with_error_feedback()],
                         ids=["powersgd1", "fp16+ef", "bf16+ef"])
def test_every_rank_ends_with_identical_weights(mode, make):
    vs = _train(make(), mode)
    _same_on_every_rank(vs)
    plain = _train(hvd.Compression.none, mode)
    assert any(np.abs(a.numpy() - b.numpy()).max() > 1e-9 for a, b in zip(vs, plain, strict=True))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", [hvd.Average, hvd.Sum], ids=["average", "sum"])
def test_full_rank_powersgd_equals_plain_allreduce(mode, op):
    compressed = _train(hvd.Compression.powersgd(rank=64, min_compression_rate=0), mode, op=op)
    plain = _train(hvd.Compression.none, mode, op=op)
    for a, b in zip(compressed, plain, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-9, atol=1e-9)


def test_saved_compressor_state_continues_identically():
    comp = hvd.Compression.powersgd(rank=2, min_compression_rate=0)
    vs = _train(comp, "eager", steps=3)
    saved = pickle.dumps(comp.state_dict())  # NumPy arrays: what a checkpoint file holds
    copy = [tf.Variable(v.numpy(), name=f"v{i}") for i, v in enumerate(vs)]  # the state is kept by name
    resumed = hvd.Compression.powersgd(rank=2, min_compression_rate=0)
    resumed.load_state_dict(pickle.loads(saved))
    _train(comp, "eager", steps=3, start=3, variables=vs)
    _train(resumed, "eager", steps=3, start=3, variables=copy)
    for a, b in zip(vs, copy, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_tf1_optimizer_with_full_rank_powersgd_equals_plain():
    results = []
    for comp in (hvd.Compression.powersgd(rank=64, min_compression_rate=0), hvd.Compression.none):
        with tf.Graph().as_default():
            vs = _model()
            x, y = _batch(0)
            opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), compression=comp)
            train = opt.minimize(_loss(vs, x, y), var_list=vs)
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                for _ in range(3):
                    sess.run(train)
                results.append(sess.run(vs))
    for a, b in zip(*results, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-9)


def test_settings_that_differ_fail_on_every_rank():
    comp = hvd.Compression.powersgd(rank=1 + (hvd.rank() == 1), min_compression_rate=0)
    with pytest.raises(HoraError, match=r"'rank' is .*rank 1: 2"):
        _train(comp, "eager", steps=1)


def test_unsupported_op_is_refused():
    with pytest.raises(HoraError, match="op=MAX"):
        _train(hvd.Compression.powersgd(rank=1), "eager", steps=1, op=hvd.Max)
