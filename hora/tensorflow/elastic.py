"""Elastic training for TensorFlow (``hvd.elastic`` of ``import hora.tensorflow as hvd``): ``TensorFlowKerasState``.

Horovod's ``horovod.tensorflow.elastic``: ``run`` and the state of a
``tf.keras`` model and optimizer.  The Keras callbacks are in
:mod:`hora.tensorflow.keras.elastic`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from hora._keras.elastic import KerasStateBase
from hora.core.elastic import ObjectState, State, run_fn
from hora.errors import HostsUpdatedInterrupt, InternalError

HorovodInternalError = InternalError
F = TypeVar("F", bound=Callable[..., Any])


def _reset() -> None:
    import hora.tensorflow as hvd

    hvd.shutdown()
    hvd.init()


def run(func: F) -> F:
    """Decorate ``func(state, ...)`` to survive lost peers and host changes (see :func:`hora.core.elastic.run_fn`)."""
    return run_fn(func, _reset)


class TensorFlowKerasState(KerasStateBase):
    """A ``tf.keras`` model's weights, its optimizer's variables and plain attributes, as elastic state."""


__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState", "State", "TensorFlowKerasState", "run"]
