"""Elastic training for Keras 3 (``hvd.elastic`` of ``import hora.keras as hvd``): Horovod's ``horovod.keras.elastic``.

::

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.CommitStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state)]

    @hvd.elastic.run
    def train(state):
        model.fit(data, epochs=epochs, initial_epoch=state.epoch, callbacks=callbacks)

    train(state)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import keras

from hora._keras.elastic import CommitStateMixin, KerasStateBase, UpdateBatchStateMixin, UpdateEpochStateMixin
from hora.core.elastic import ObjectState, State, run_fn
from hora.errors import HostsUpdatedInterrupt, InternalError

HorovodInternalError = InternalError
F = TypeVar("F", bound=Callable[..., Any])


def _reset() -> None:
    import hora.keras as hvd

    hvd.shutdown()
    hvd.init()


def run(func: F) -> F:
    """Decorate ``func(state, ...)`` to survive lost peers and host changes (see :func:`hora.core.elastic.run_fn`).

    On the TensorFlow backend the train step is a graph, whose collectives
    report a lost peer as a TensorFlow error: hora.tensorflow's translation
    turns it back into :class:`InternalError`.
    """
    if keras.backend.backend() == "tensorflow":
        from hora.tensorflow.elastic import translate_lost_peers

        func = translate_lost_peers(func)
    return run_fn(func, _reset)


class KerasState(KerasStateBase):
    """A Keras model's weights, its optimizer's variables and plain attributes, as elastic state."""


class CommitStateCallback(CommitStateMixin, keras.callbacks.Callback):
    """Commit the state every ``batches_per_commit`` batches."""


class UpdateBatchStateCallback(UpdateBatchStateMixin, keras.callbacks.Callback):
    """Keep ``state.batch`` current."""


class UpdateEpochStateCallback(UpdateEpochStateMixin, keras.callbacks.Callback):
    """Keep ``state.epoch`` at the next epoch to run."""


__all__ = ["CommitStateCallback", "HorovodInternalError", "HostsUpdatedInterrupt", "KerasState", "ObjectState",
           "State", "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]
