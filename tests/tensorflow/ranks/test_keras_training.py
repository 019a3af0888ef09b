"""Keras training on every rank, for the flavour the job runs (HORA_TEST_KERAS=keras3 on KERAS_BACKEND, or
tfkeras): the equivalence of 2 ranks x B with 1 process x 2B, and Horovod's callback semantics."""

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

BATCH = 8
FEATURES = 6


def make_model(seed: int):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(3)])
    return model


def data(steps: int):
    rng = np.random.default_rng(1234)
    x = rng.normal(size=(steps, BATCH * hvd.size(), FEATURES)).astype("float32")
    y = rng.integers(0, 3, size=(steps, BATCH * hvd.size())).astype("int32")
    return x, y


def loss_fn():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.mark.parametrize("make_opt", [lambda: keras.optimizers.SGD(0.1, momentum=0.9),
                                      lambda: keras.optimizers.Adam(0.01)], ids=["sgd", "adam"])
def test_ranks_times_batch_equal_one_process_times_global_batch(make_opt):
    """Each rank trains on its B rows of a 2B (or 3B) batch; one local model trains on all rows: same weights."""
    steps, r = 4, hvd.rank()
    x, y = data(steps)
    reference = make_model(0)
    reference.compile(optimizer=make_opt(), loss=loss_fn())
    model = make_model(0)
    model.set_weights(reference.get_weights())
    model.compile(optimizer=hvd.DistributedOptimizer(make_opt()), loss=loss_fn())
    for s in range(steps):
        reference.train_on_batch(x[s], y[s])
        model.train_on_batch(x[s][r * BATCH:(r + 1) * BATCH], y[s][r * BATCH:(r + 1) * BATCH])
    for got, want in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


def test_callbacks_broadcast_average_and_warmup():
    r, n = hvd.rank(), hvd.size()
    steps_per_epoch, epochs, lr = 4, 3, 0.05 * n
    model = make_model(100 + r)  # different weights on every rank: the callback must fix that
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(lr)), loss=loss_fn())
    root_weights = hvd.broadcast_object([w for w in model.get_weights()], root_rank=0)
    seen_lr, local_logs, first_weights = [], [], []

    class LogProbe(keras.callbacks.Callback):  # before MetricAverageCallback: sees this rank's own logs
        def on_train_batch_begin(self, batch, logs=None):
            if not first_weights:
                first_weights.append(self.model.get_weights())

        def on_epoch_end(self, epoch, logs=None):
            local_logs.append(dict(logs))

    class LrProbe(keras.callbacks.Callback):  # after the warmup: sees the rate the batch runs with
        def on_train_batch_begin(self, batch, logs=None):
            seen_lr.append(float(np.asarray(self.model.optimizer.learning_rate)))

    x, y = data(steps_per_epoch)
    xs = x.reshape(-1, FEATURES)[r::n]
    ys = y.reshape(-1)[r::n] if r == 0 else (y.reshape(-1)[r::n] + 1) % 3  # ranks see different losses
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                 LogProbe(),
                 hvd.callbacks.MetricAverageCallback(),
                 hvd.callbacks.LearningRateWarmupCallback(initial_lr=lr, warmup_epochs=2,
                                                          steps_per_epoch=steps_per_epoch, verbose=1),
                 LrProbe()]
    history = model.fit(xs, ys, batch_size=len(xs) // steps_per_epoch, epochs=epochs, callbacks=callbacks,
                        verbose=0, shuffle=False)
    # the root's weights reached every rank before the first batch
    for got, want in zip(first_weights[0], root_weights, strict=True):
        np.testing.assert_allclose(got, want)
    # warmup: lr/size at the start, lr at the end of the warmup, Horovod's formula in between
    for i, value in enumerate(seen_lr[: 2 * steps_per_epoch]):
        epoch = i / steps_per_epoch + 1 / steps_per_epoch
        np.testing.assert_allclose(value, lr / n * (epoch * (n - 1) / 2 + 1), rtol=1e-5)
    np.testing.assert_allclose(seen_lr[-1], lr, rtol=1e-6)
    # History holds the average over ranks of what each rank measured (LogProbe ran before the average)
    local = np.array([logs["loss"] for logs in local_logs])
    everyone = np.array(hvd.allgather_object(local.tolist()))
    np.testing.assert_allclose(history.history["loss"], everyone.mean(0), rtol=1e-5)
    # logs["lr"]: the rate at the end of each epoch
    np.testing.assert_allclose(history.history["lr"], [seen_lr[steps_per_epoch - 1], lr, lr], rtol=1e-6)
    # weights are identical on every rank afterwards
    w = model.get_weights()[0]
    gathered = hvd.allgather_object(w)
    for other in gathered:
        np.testing.assert_allclose(other, w, rtol=1e-6)


def test_best_model_checkpoint_writes_on_rank_zero_only(tmp_path):
    r = hvd.rank()
    path = tmp_path / f"rank{r}" / "best.keras"
    path.parent.mkdir()
    model = make_model(0)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss=loss_fn())
    x, y = data(2)
    model.fit(x.reshape(-1, FEATURES), y.reshape(-1), validation_split=0.25, epochs=2, verbose=0,
              callbacks=[hvd.callbacks.MetricAverageCallback(), hvd.callbacks.BestModelCheckpoint(str(path))])
    assert path.exists() == (r == 0)


def test_load_model_rewraps_the_optimizer(tmp_path):
    from hora._keras.optimizer import is_distributed

    model = make_model(0)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss=loss_fn())
    x, y = data(2)
    r = hvd.rank()
    model.train_on_batch(x[0][r * BATCH:(r + 1) * BATCH], y[0][r * BATCH:(r + 1) * BATCH])
    path = tmp_path / "model.keras"
    model.save(str(path))
    loaded = hvd.load_model(str(path))
    assert type(loaded.optimizer).__name__ == "Adam"
    assert is_distributed(loaded.optimizer)
    loaded.train_on_batch(x[1][r * BATCH:(r + 1) * BATCH], y[1][r * BATCH:(r + 1) * BATCH])
    w = loaded.get_weights()[0]
    for other in hvd.allgather_object(w):
        np.testing.assert_allclose(other, w, rtol=1e-6)


@pytest.mark.parametrize("run_eagerly", [False, True], ids=["compiled", "eager"])
def test_backward_passes_per_step_applies_every_n_steps(run_eagerly):
    """backward_passes_per_step=2: nothing applied on the first step, the mean of both global batches' gradients on
    the second, and one grouped allreduce per 2 steps (counted on the eager step, where Python runs each time)."""
    model = make_model(0)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2,
                                   average_aggregated_gradients=True)
    calls = []
    reduce = opt.hora_reduce  # the backend's reduction, counted on this instance
    object.__setattr__(opt, "hora_reduce", lambda grads, variables, reduction: calls.append(1)
                       or reduce(grads, variables, reduction))
    model.compile(optimizer=opt, loss=loss_fn(), run_eagerly=run_eagerly)
    reference = make_model(0)
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss_fn())
    x, y = data(4)
    r = hvd.rank()
    before = model.get_weights()
    model.train_on_batch(x[0][r * BATCH:(r + 1) * BATCH], y[0][r * BATCH:(r + 1) * BATCH])
    for got, want in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(got, want)
    assert int(np.asarray(opt.iterations)) == 1  # the step counts although nothing was applied
    model.train_on_batch(x[1][r * BATCH:(r + 1) * BATCH], y[1][r * BATCH:(r + 1) * BATCH])
    # one update with the mean of the two global batches' gradients
    reference.train_on_batch(np.concatenate([x[0], x[1]]), np.concatenate([y[0], y[1]]))
    for got, want in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)
    for s in (2, 3):
        model.train_on_batch(x[s][r * BATCH:(r + 1) * BATCH], y[s][r * BATCH:(r + 1) * BATCH])
    assert int(np.asarray(opt.iterations)) == 4 and int(np.asarray(opt._agg_helper.counter)) == 0
    if run_eagerly:
        assert len(calls) == 2, f"{len(calls)} reductions in 4 steps with backward_passes_per_step=2"


def test_aggregated_gradients_are_summed_unless_averaged():
    """Horovod's default (average_aggregated_gradients=False) applies the sum of the N steps' gradients."""
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=3)
    r, n = hvd.rank(), hvd.size()
    if FLAVOUR == "tfkeras":
        w = tf.Variable(np.zeros(2, np.float32))
    else:
        w = keras.Variable(np.zeros(2, np.float32))
    for step in range(6):
        grad = np.full(2, float(r + step), np.float32)
        if FLAVOUR == "tfkeras":
            opt.apply_gradients([(tf.constant(grad), w)])
        else:
            opt.apply([keras.ops.convert_to_tensor(grad)], [w])
        if step in (0, 1, 3, 4):  # nothing applied between the every-3rd steps
            np.testing.assert_allclose(np.asarray(w), -np.full(2, sum(range(step - step % 3))
                                                                + (n - 1) / 2 * 3 * (step // 3)), rtol=1e-6)
    # -(sum of the steps' mean-over-ranks gradients) = -(sum(steps) + 6 * mean(ranks))
    np.testing.assert_allclose(np.asarray(w), -np.full(2, sum(range(6)) + 6 * (n - 1) / 2), rtol=1e-6)
    assert int(np.asarray(opt.iterations)) == 6


@pytest.mark.parametrize("groups", ["count", "variables"])
def test_groups_compression_and_predivide_on_every_backend(monkeypatch, groups):
    """``groups`` splits a step's gradients into grouped allreduces on Keras 3 (TensorFlow and torch) and tf_keras;
    with fp16 compression and a predivide factor the result is still the average."""
    from hora.core import collectives
    from hora.core.ops import CollectiveType

    r, n = hvd.rank(), hvd.size()
    make = tf.Variable if FLAVOUR == "tfkeras" else keras.Variable
    variables = [make(np.zeros(k, np.float32)) for k in (2, 3, 4)]
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), compression=hvd.Compression.fp16,
                                   gradient_predivide_factor=2.0,
                                   groups=3 if groups == "count" else [[variables[2], variables[0]]])
    sent = []
    submit = collectives.submit

    def counting(kind, tensors, **kwargs):
        if kind == CollectiveType.ALLREDUCE:
            sent.append([str(np.asarray(t).dtype) for t in tensors])
        return submit(kind, tensors, **kwargs)

    monkeypatch.setattr(collectives, "submit", counting)
    grads = [np.full(k, float(r + 1), np.float32) for k in (2, 3, 4)]
    if FLAVOUR == "tfkeras":
        opt.apply_gradients([(tf.constant(g), v) for g, v in zip(grads, variables, strict=True)])
    else:
        opt.apply([keras.ops.convert_to_tensor(g) for g in grads], variables)
    for v in variables:
        np.testing.assert_allclose(np.asarray(v), -(n + 1) / 2)  # lr 1 x the mean of 1..n
    expected = [1, 1, 1] if groups == "count" else [2, 1]
    assert sorted((len(dtypes) for dtypes in sent), reverse=True) == expected, sent
    assert all(d == "float16" for dtypes in sent for d in dtypes), sent


@pytest.mark.skipif(FLAVOUR != "tfkeras", reason="Horovod's _compute_gradients is a tf_keras optimizer method")
def test_compute_gradients_reduces_once():
    """Horovod's wrapper method returns reduced gradients; applying them does not reduce them again."""
    r, n = hvd.rank(), hvd.size()
    w = tf.Variable([1.0, 1.0])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hvd.Sum)

    @tf.function
    def step():
        pairs = opt._compute_gradients(lambda: tf.reduce_sum(w * float(r + 1)), var_list=[w])
        opt.apply_gradients(pairs)
        return pairs[0][0]

    grad = step()
    np.testing.assert_allclose(grad.numpy(), [n * (n + 1) / 2] * 2)  # summed over ranks, once
    np.testing.assert_allclose(w.numpy(), [1.0 - n * (n + 1) / 2] * 2)


@pytest.mark.skipif(FLAVOUR != "tfkeras", reason="a tf_keras optimizer given to hora.keras")
def test_hora_keras_hands_tf_keras_optimizers_to_the_tf_binding():
    import hora.keras

    local = tf.Variable([2.0])
    opt = hora.keras.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), local_layers=None)
    opt.register_local_var(local)
    r, n = hvd.rank(), hvd.size()
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_sum(local * float(r + 1))
    ((grad, _),) = opt._compute_gradients(loss, [local], tape=tape)
    np.testing.assert_allclose(grad.numpy(), [(r + 1) / n])  # local: divided by the ranks, not reduced


def test_keras_state_restores_to_what_sync_made_it():
    """After sync() every rank holds rank 0's weights, and a restore() before any commit goes back to them."""
    r = hvd.rank()
    model = make_model(0)
    model.set_weights([np.full_like(w, r + 1.0) for w in model.get_weights()])
    state = hvd.elastic.KerasState(model, keras.optimizers.SGD(0.1), batch=20 + r)
    state.sync()
    for w in model.get_weights():
        np.testing.assert_array_equal(w, np.ones_like(w))
    model.set_weights([np.full_like(w, 7.0) for w in model.get_weights()])
    state.batch = 21
    state.restore()
    for w in model.get_weights():
        np.testing.assert_array_equal(w, np.ones_like(w))
    assert state.batch == 20
