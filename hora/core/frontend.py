"""Framework-free helpers that every binding's front (hora.tensorflow, hora.keras, ...) shares.

Horovod's API has a few pieces of arithmetic and argument handling that do not
depend on the framework: the ``average=``/``op=`` pair, the options of a
gradient reduction (``DistributedOptimizer``'s and ``DistributedGradientTape``'s),
the bytes of a pickled object sent by ``broadcast_object``, and the
learning-rate warmup schedule of the Keras callbacks.  They live here once, so
that bindings do not copy them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import cloudpickle
import numpy as np

from hora.core.ops import ReduceOp
from hora.core.runtime import ProcessSet, global_process_set
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


#: ``groups=``: None (one grouped allreduce), a count of allreduces, or lists of variables reduced together
Groups = int | Sequence[Sequence[Any]] | None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GradientReduction:
    """How a binding reduces a list of gradients across ranks, checked once (build it with :func:`gradient_reduction`).

    A binding's reduction function (``hora.tensorflow.gradients.reduce_gradients``,
    Keras 3's torch backend in ``hora.keras.reduction``) reads these and nothing else.

    Attributes:
        op: the reduction operator, already resolved.
        prescale: factor on each gradient before the sum (``1 / gradient_predivide_factor``).
        postscale: factor on the result (``gradient_predivide_factor``).
        compression: the compressor (``compress(t) -> (t, ctx)``, ``decompress(t, ctx) -> t``),
            which the reduction function applies to each dense gradient; None sends them as they are.
        groups: None (every gradient in one grouped allreduce), a number of
            grouped allreduces, or lists of variables whose gradients travel together.
        sparse_as_dense: turn sparse gradients (``tf.IndexedSlices``) into dense ones first.
        process_set: the ranks that reduce together.
    """

    op: ReduceOp = ReduceOp.AVERAGE
    prescale: float = 1.0
    postscale: float = 1.0
    compression: Any = None
    groups: Groups = None
    sparse_as_dense: bool = False
    process_set: ProcessSet = global_process_set

    def skips(self) -> bool:
        """True where gradients are returned as they are: a one-rank set, or a rank outside it (as in Horovod)."""
        ranks = self.process_set.ranks
        return ranks is not None and (len(ranks) <= 1 or not self.process_set.included())

    def index_groups(self, grads: Sequence[Any], variables: Sequence[Any] | None) -> list[list[int]]:
        """The positions of the present (not None) gradients, grouped as they travel: one grouped allreduce each.

        Raises:
            ValueError: ``groups`` is lists of variables but ``variables`` is None.
        """
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return []
        groups = self.groups
        if isinstance(groups, int):
            if groups <= 0:
                return [present]
            size = -(-len(present) // groups)
            return [present[i: i + size] for i in range(0, len(present), size)]
        if groups is None:
            return [present]
        if variables is None:
            raise ValueError("groups given as lists of variables need the variables of the gradients")
        where = {id(v): i for i, v in enumerate(variables)}
        index_groups, taken = [], set()
        for group in groups:
            idx = [where[id(v)] for v in group if id(v) in where and grads[where[id(v)]] is not None]
            taken.update(idx)
            if idx:
                index_groups.append(idx)
        return index_groups + [[i] for i in present if i not in taken]


def gradient_reduction(*, op: ReduceOp | int | None = ReduceOp.AVERAGE, gradient_predivide_factor: float = 1.0,
                       compression: Any = None, groups: Groups = None, num_groups: int = 0,
                       sparse_as_dense: bool = False,
                       process_set: ProcessSet = global_process_set) -> GradientReduction:
    """Horovod's ``DistributedOptimizer`` options as one checked :class:`GradientReduction`.

    ``num_groups`` is Horovod's older name for an integer ``groups``.

    Raises:
        ValueError: ``gradient_predivide_factor`` not above 0, or other than 1 with an op other than Average.
        UnsupportedError: ``op=Adasum``.
    """
    op = resolve_op(None, op)
    if not gradient_predivide_factor > 0:
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor} must be > 0")
    if gradient_predivide_factor != 1.0 and op != ReduceOp.AVERAGE:
        raise ValueError("gradient_predivide_factor is only valid with op=hvd.Average")
    if groups is None and num_groups:
        groups = num_groups
    if getattr(compression, "stateful", False):  # refuse op=Max when the optimizer is built, not at its first step
        compression.check_op(op)
    return GradientReduction(op=op, prescale=1.0 / gradient_predivide_factor,
                             postscale=float(gradient_predivide_factor), compression=compression, groups=groups,
                             sparse_as_dense=sparse_as_dense, process_set=process_set)


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


__all__ = ["GradientReduction", "Groups", "bytes_to_object", "gradient_reduction", "object_to_bytes", "resolve_op",
           "split_gathered_bytes", "warmup_multiplier"]
