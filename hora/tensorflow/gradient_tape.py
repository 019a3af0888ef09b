"""``DistributedGradientTape``: a ``tf.GradientTape`` whose gradients are averaged across ranks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from hora.core.frontend import gradient_reduction
from hora.core.ops import ReduceOp
from hora.core.runtime import ProcessSet, global_process_set
from hora.tensorflow.compression import Compression
from hora.tensorflow.gradients import reduce_gradients, scale_local


def _flat(x: Any) -> list[Any]:
    return tf.nest.flatten(x)


def _key(source: Any) -> Any:
    """A hashable identity for a tape source: tf.Variable.ref(), or the object for Keras 3 variables."""
    return source.ref() if hasattr(source, "ref") else id(source)


class DistributedGradientTape:
    """Wraps a recorded ``tf.GradientTape``: ``gradient()`` returns gradients averaged over the ranks.

    Every other attribute (``watch``, ``stop_recording``, ``jacobian``...) is
    the wrapped tape's.  Sources registered with
    :meth:`register_local_source` are not reduced; with
    ``scale_local_gradients`` their gradients are divided by the number of
    ranks, as in Horovod.
    """

    def __init__(self, gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                 compression: Any = Compression.none, sparse_as_dense: bool = False,
                 op: ReduceOp | int = ReduceOp.AVERAGE, gradient_predivide_factor: float = 1.0,
                 num_groups: int = 0, groups: int | Sequence[Sequence[tf.Variable]] | None = None,
                 process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True) -> None:
        self._reduction = gradient_reduction(op=op, gradient_predivide_factor=gradient_predivide_factor,
                                             compression=compression, groups=groups, num_groups=num_groups,
                                             sparse_as_dense=sparse_as_dense, process_set=process_set)
        self._tape = gradtape
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self._local_sources: set[Any] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tape, name)

    def __enter__(self) -> DistributedGradientTape:
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._tape.__exit__(*exc)

    def register_local_source(self, source: Any) -> None:
        """Keep ``source``'s gradient local to this rank (model-parallel parameters)."""
        self._local_sources.add(_key(source))

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None, use_generic_names: bool = False,
                 **kwargs: Any) -> Any:
        """The wrapped tape's gradients, averaged (or reduced with ``op``) across the process set."""
        grads = self._tape.gradient(target, sources, output_gradients, **kwargs)
        flat_sources, flat_grads = _flat(sources), _flat(grads)
        reduce_idx = [i for i, s in enumerate(flat_sources) if _key(s) not in self._local_sources]
        reduced = reduce_gradients([flat_grads[i] for i in reduce_idx], [flat_sources[i] for i in reduce_idx],
                                   self._reduction)
        out = list(flat_grads)
        for i, g in zip(reduce_idx, reduced, strict=True):
            out[i] = g
        if self.scale_local_gradients and self._local_sources:
            size = self.process_set.size() or 1
            for i, s in enumerate(flat_sources):
                if _key(s) in self._local_sources:
                    out[i] = scale_local(out[i], size)
        return tf.nest.pack_sequence_as(grads, out)

    def get_local_and_global_gradients(self, target: Any, sources: Any, output_gradients: Any = None,
                                       use_generic_names: bool = False) -> tuple[list, list]:
        """``(local, global)`` lists of ``(source, gradient)`` pairs."""
        grads = self.gradient(target, sources, output_gradients)
        local, glob = [], []
        for s, g in zip(_flat(sources), _flat(grads), strict=True):
            (local if _key(s) in self._local_sources else glob).append((s, g))
        return local, glob


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "",
                                   compression: Any = Compression.none, sparse_as_dense: bool = False,
                                   op: ReduceOp | int = ReduceOp.AVERAGE, gradient_predivide_factor: float = 1.0,
                                   num_groups: int = 0, groups: Any = None,
                                   process_set: ProcessSet = global_process_set, local_layers: Any = None,
                                   scale_local_gradients: bool = True) -> DistributedGradientTape:
    """A :class:`DistributedGradientTape` whose ``local_layers``' variables keep their local gradients."""
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set,
                                   scale_local_gradients)
    if local_layers is None:
        return tape
    layers = local_layers if isinstance(local_layers, list | tuple) else [local_layers]
    for layer in layers:
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape


__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape"]
