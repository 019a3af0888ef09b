"""KerasState and the elastic Keras callbacks (hora.keras on Keras 3, hora.tensorflow on tf.keras), one process."""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")
pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def hvd():
    import hora.keras as hvd

    hvd.init()
    yield hvd
    hvd.shutdown()


def _model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    return model


def test_keras_state_commits_through_the_callbacks_and_restores(hvd):
    model = _model()
    state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    x, y = np.ones((8, 3), np.float32), np.zeros((8, 2), np.float32)
    callbacks = [hvd.elastic.CommitStateCallback(state, batches_per_commit=2),
                 hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state)]
    model.fit(x, y, batch_size=2, epochs=2, initial_epoch=state.epoch, callbacks=callbacks, verbose=0)
    assert (state.epoch, state.batch) == (2, 0)
    committed = [w.copy() for w in model.get_weights()]
    momentum = [v.numpy() for v in model.optimizer.variables]
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # uncommitted progress
    assert not all(np.array_equal(a, b) for a, b in zip(model.get_weights(), committed, strict=True))
    state.restore()
    for a, b in zip(model.get_weights(), committed, strict=True):
        np.testing.assert_array_equal(a, b)
    for v, m in zip(model.optimizer.variables, momentum, strict=True):
        np.testing.assert_array_equal(v.numpy(), m)


def test_keras_state_sync_builds_an_unbuilt_optimizer(hvd):
    model = _model()
    state = hvd.elastic.KerasState(model, epoch=3)
    assert not model.optimizer.built
    state.sync()  # a worker that joined before stepping: its optimizer variables must exist to be broadcast
    assert model.optimizer.built and state.epoch == 3


def test_commit_callback_refuses_a_zero_interval(hvd):
    state = hvd.elastic.KerasState(_model())
    with pytest.raises(ValueError, match="batches_per_commit"):
        hvd.elastic.CommitStateCallback(state, batches_per_commit=0)


def test_keras_state_commits_the_optimizers_compressor_by_reference(hvd):
    compression = hvd.Compression.powersgd(rank=2)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=compression), loss="mse")
    state = hvd.elastic.KerasState(model, epoch=0)
    compression.step = 4
    state.commit()
    compression.step = 9  # progress after the commit
    state.restore()
    assert compression.step == 4
    state.sync()  # rank 0's step and factors (this process is rank 0 of 1)
    assert compression.step == 4 and state.epoch == 0
