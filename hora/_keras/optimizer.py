"""The distributed form of a Keras optimizer class, for Keras 3 (``apply``) and tf_keras (``apply_gradients``).

``DistributedOptimizer(opt)`` returns an instance of a subclass of
``type(opt)`` that reduces the gradients across ranks, then lets the
optimizer apply them.  It is a subclass, not a wrapper, so that Keras
compiles, saves and restores it as the optimizer it was (the subclass keeps
the class's name and module), ``isinstance`` checks still hold, and
``load_model`` can map the saved class name back to the distributed class.
One subclass is made per optimizer class and Keras flavour, and cached.

The reduction itself (a ``tf.py_function`` inside TensorFlow graphs, torch
tensors through the core on Keras's torch backend) is the binding's, given as
``make_reducer``: a function of no arguments returning ``reduce(grads,
variables) -> grads``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Reducer = Callable[[Sequence[Any], Sequence[Any] | None], list[Any]]

_CLASSES: dict[tuple[type, str], type] = {}


def distributed_class(cls: type, hook: str, default_reducer: Callable[[], Reducer]) -> type:
    """The cached subclass of optimizer class ``cls`` that reduces gradients in ``hook``.

    Args:
        cls: a Keras optimizer class.
        hook: ``"apply"`` (Keras 3's one entry for applying gradients) or
            ``"apply_gradients"`` (tf_keras's).
        default_reducer: makes the reducer used when an instance was created
            by Keras itself (``from_config`` while loading a model) rather
            than by ``DistributedOptimizer``.
    """
    key = (cls, hook)
    if key in _CLASSES:
        return _CLASSES[key]
    if hook == "apply":
        class Distributed(cls):
            def apply(self, grads, trainable_variables=None):
                variables = list(trainable_variables) if trainable_variables is not None else None
                grads = reduce_gradients(self, list(grads), variables)
                return super().apply(grads, trainable_variables)

            def register_local_var(self, var: Any) -> None:
                """Keep ``var``'s gradient local to this rank (divided by the number of ranks)."""
                register_local_var(self, var)
    elif hook == "apply_gradients":
        class Distributed(cls):
            def apply_gradients(self, grads_and_vars, *args, **kwargs):
                pairs = list(grads_and_vars)
                grads = reduce_gradients(self, [g for g, _ in pairs], [v for _, v in pairs])
                return super().apply_gradients(list(zip(grads, [v for _, v in pairs], strict=True)), *args,
                                               **kwargs)

            def register_local_var(self, var: Any) -> None:
                """Keep ``var``'s gradient local to this rank (divided by the number of ranks)."""
                register_local_var(self, var)
    else:
        raise ValueError(f"unknown optimizer hook {hook!r}")
    Distributed.__name__ = cls.__name__
    Distributed.__qualname__ = cls.__qualname__
    Distributed.__module__ = cls.__module__
    Distributed.__doc__ = f"{cls.__name__} whose gradients hora reduces across ranks before they are applied."
    Distributed.hora_default_reducer = staticmethod(default_reducer)
    _CLASSES[key] = Distributed
    return Distributed


def register_local_var(optimizer: Any, var: Any) -> None:
    """Mark ``var`` as local: its gradient is not reduced (Horovod's PartialDistributedOptimizer)."""
    local = getattr(optimizer, "hora_local_vars", None)
    if local is None:
        local = set()
        object.__setattr__(optimizer, "hora_local_vars", local)
    local.add(id(var))


def _scaled(grad: Any, factor: float) -> Any:
    if grad is None:
        return None
    if hasattr(grad, "indices") and hasattr(grad, "values") and hasattr(grad, "dense_shape"):
        return type(grad)(grad.values * factor, grad.indices, grad.dense_shape)
    return grad * factor


def reduce_gradients(optimizer: Any, grads: list[Any], variables: list[Any] | None) -> list[Any]:
    """The gradients reduced by the optimizer's reducer; local variables' are divided by the size instead."""
    reducer = reducer_of(optimizer)
    local = getattr(optimizer, "hora_local_vars", None)
    if not local or variables is None:
        return reducer(grads, variables)
    from hora.core import runtime

    idx = [i for i, v in enumerate(variables) if id(v) not in local]
    reduced = reducer([grads[i] for i in idx], [variables[i] for i in idx])
    out = [_scaled(g, 1.0 / runtime.current().engine.size) for g in grads]
    for i, r in zip(idx, reduced, strict=True):
        out[i] = r
    return out


def reducer_of(optimizer: Any) -> Reducer:
    """The reducer attached to a distributed optimizer, made with the defaults on first use."""
    reducer = getattr(optimizer, "hora_reducer", None)
    if reducer is None:
        reducer = type(optimizer).hora_default_reducer()
        attach_reducer(optimizer, reducer)
    return reducer


def attach_reducer(optimizer: Any, reducer: Reducer) -> None:
    """Give a distributed optimizer the reducer built from ``DistributedOptimizer``'s options."""
    object.__setattr__(optimizer, "hora_reducer", reducer)


def is_distributed(optimizer: Any) -> bool:
    """True for an optimizer made by ``DistributedOptimizer`` (or restored as one by ``load_model``)."""
    return hasattr(type(optimizer), "hora_default_reducer")


__all__ = ["attach_reducer", "distributed_class", "is_distributed", "reduce_gradients", "reducer_of",
           "register_local_var"]
