"""Framework-free helpers that every binding's front (hora.tensorflow, hora.keras, ...) shares.

Horovod's API has a few pieces of arithmetic and argument handling that do not
depend on the framework: the ``average=``/``op=`` pair, the bytes of a pickled
object sent by ``broadcast_object``, and the learning-rate warmup schedule of
the Keras callbacks.  They live here once, so that bindings do not copy them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import cloudpickle
import numpy as np

from hora.core.ops import ReduceOp
from hora.errors import UnsupportedError


def resolve_op(average: bool | None, op: ReduceOp | int | None, default: ReduceOp = ReduceOp.AVERAGE) -> ReduceOp:
    """Horovod's deprecated ``average=`` and its ``op=`` as one operator.

    Raises:
        ValueError: both were given.
        UnsupportedError: ``op=Adasum``, which hora does not implement.
    """
    if average is not None and op is not None:
        raise ValueError("average and op are mutually exclusive; pass only op=")
    if op is None:
        op = default if average is None else (ReduceOp.AVERAGE if average else ReduceOp.SUM)
    op = ReduceOp(int(op))
    if op == ReduceOp.ADASUM:
        raise UnsupportedError("op=hvd.Adasum is not supported by hora yet; use hvd.Average or hvd.Sum")
    return op


def object_to_bytes(obj: Any) -> np.ndarray:
    """``obj`` pickled (cloudpickle, so lambdas and local classes travel) as a uint8 array."""
    return np.frombuffer(cloudpickle.dumps(obj), dtype=np.uint8).copy()


def bytes_to_object(data: np.ndarray | bytes) -> Any:
    """The inverse of :func:`object_to_bytes`."""
    raw = data if isinstance(data, bytes) else np.asarray(data, dtype=np.uint8).tobytes()
    return cloudpickle.loads(raw)


def split_gathered_bytes(data: np.ndarray, sizes: Sequence[int]) -> list[Any]:
    """Objects from the concatenated pickles of an allgather, given each rank's byte count."""
    out, offset = [], 0
    raw = np.asarray(data, dtype=np.uint8).tobytes()
    for n in sizes:
        out.append(cloudpickle.loads(raw[offset: offset + int(n)]))
        offset += int(n)
    return out


def warmup_multiplier(epoch: float, size: int, warmup_epochs: float) -> float:
    """Horovod's gradual warmup factor at a (fractional) epoch: from ``1/size`` to 1.

    The learning rate of a job of ``size`` ranks starts at ``initial_lr /
    size`` (the single-process rate) and grows linearly to ``initial_lr`` at
    ``warmup_epochs`` (Goyal et al., "Accurate, Large Minibatch SGD").
    """
    if warmup_epochs <= 0:
        return 1.0
    return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1.0)


__all__ = ["bytes_to_object", "object_to_bytes", "resolve_op", "split_gathered_bytes", "warmup_multiplier"]
