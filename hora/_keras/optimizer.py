"""The distributed form of a Keras optimizer, for Keras 3 (``apply``) and tf_keras (``apply_gradients``).

:func:`make_distributed` is what ``hvd.DistributedOptimizer(opt)`` of both
``hora.keras`` and ``hora.tensorflow.keras`` does: it returns an instance of a
subclass of ``type(opt)``, with ``opt``'s config and fresh state, that
reduces the gradients across ranks and then lets the optimizer apply them.
It is a subclass, not a wrapper, so that Keras compiles, saves and restores
it as the optimizer it was (the subclass keeps the class's name and module),
``isinstance`` checks still hold, and ``load_model`` can map the saved class
name back to the distributed class.  The methods are those of the plain
classes :class:`Keras3Distributed` and :class:`TfKerasDistributed`; the
subclass only puts one of them before the optimizer's class, so it has to be
made when the optimizer's class is known, once per class and kept.

The reduction is the binding's, one function per Keras backend with the
signature ``reduce(grads, variables, reduction) -> grads`` (a
:class:`~hora.core.frontend.GradientReduction` holds the options, checked
once); the class holds the function, the instance its options.  With
``backward_passes_per_step`` the optimizer also carries a
:class:`~hora._keras.aggregation.LocalAggregation`: gradients are summed
locally and reduced and applied every N steps.

tf_keras optimizers also get Horovod's ``_compute_gradients(loss, var_list,
grad_loss, tape)``, which returns the reduced gradients; ``apply_gradients``
recognises them and does not reduce them a second time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from hora._keras.aggregation import AggregationOps, LocalAggregation
from hora._keras.compression_state import read_dir, save_to_dir
from hora.core.compression import is_stateful
from hora.core.frontend import GradientReduction

#: a Keras backend's gradient reduction: ``(grads, variables, reduction) -> reduced grads``
ReduceFn = Callable[[Sequence[Any], Sequence[Any] | None, GradientReduction], list[Any]]

_CLASSES: dict[tuple[type, str, ReduceFn], type] = {}


class CompressionStateMixin:
    """A stateful compressor's state saved and loaded with the optimizer (both Kerases).

    ``model.save("….keras")`` calls ``save_assets`` on the optimizer, and
    ``load_model`` calls ``load_assets``: the compressor's state travels in
    the archive's assets, beside the optimizer's variables, not among them, so
    that a Keras without hora still loads the optimizer's own variables.
    ``compression_state_dict`` and ``load_compression_state_dict`` are the same
    state for checkpoints of one's own (``torch.save`` on the torch backend).
    """

    def save_assets(self, dir_path: str) -> None:
        base = getattr(super(), "save_assets", None)
        if base is not None:
            base(dir_path)
        save_to_dir(compressor_of(self), dir_path)

    def load_assets(self, dir_path: str) -> None:
        base = getattr(super(), "load_assets", None)
        if base is not None:
            base(dir_path)
        state = read_dir(dir_path)
        if state is not None:
            self.load_compression_state_dict(state)

    def compression_state_dict(self) -> dict[str, Any] | None:
        """The stateful compressor's ``state_dict()`` (None with a stateless one): per-rank, save it on every rank."""
        compressor = compressor_of(self)
        return compressor.state_dict() if compressor is not None else None

    def load_compression_state_dict(self, state: dict[str, Any]) -> None:
        """Load :meth:`compression_state_dict`; kept until a stateful compressor is attached (``load_model``)."""
        compressor = compressor_of(self)
        if compressor is not None:
            compressor.load_state_dict(state)
        else:
            object.__setattr__(self, "hora_pending_compression", state)


class Keras3Distributed(CompressionStateMixin):
    """What a Keras 3 optimizer becomes: it reduces the gradients in ``apply``, Keras 3's one entry for them."""

    def build(self, variables):
        super().build(variables)
        agg = aggregation_of(self)
        if agg is not None:
            agg.build(list(variables))

    def apply(self, grads, trainable_variables=None):
        agg = aggregation_of(self)
        if agg is None:
            variables = list(trainable_variables) if trainable_variables is not None else None
            return super().apply(reduced_gradients(self, list(grads), variables), trainable_variables)
        variables = list(trainable_variables if trainable_variables is not None else self._trainable_variables)
        if not self.built:
            self.build(variables)
            self.built = True
        accumulated = agg.accumulate(list(grads), variables)
        parent = super().apply

        def apply_reduced():
            parent(reduced_gradients(self, accumulated, variables), variables)

        agg.apply_when_ready(apply_reduced, lambda: self.iterations.assign_add(1))
        return None

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient local to this rank (divided by the number of ranks)."""
        register_local_var(self, var)


class TfKerasDistributed(CompressionStateMixin):
    """What a tf_keras optimizer becomes: it reduces gradients in ``apply_gradients`` (or ``_compute_gradients``)."""

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        """The ``(gradient, variable)`` pairs of ``loss``, reduced across ranks (Horovod's method).

        ``apply_gradients`` then applies them without reducing them again.
        """
        base = getattr(super(), "_compute_gradients", None)
        if base is not None:  # tf_keras's legacy optimizers
            pairs = base(loss, var_list, grad_loss=grad_loss, tape=tape)
        else:
            pairs = self.compute_gradients(loss, var_list, tape=tape)
        variables = [v for _, v in pairs]
        grads = prepare_gradients(self, [g for g, _ in pairs], variables)
        # what apply_gradients need not reduce again (held, so that their ids stay theirs)
        object.__setattr__(self, "hora_prepared", {id(g): g for g in grads if g is not None})
        return list(zip(grads, variables, strict=True))

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        pairs = list(grads_and_vars)
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        prepared = getattr(self, "hora_prepared", None) or {}
        object.__setattr__(self, "hora_prepared", None)
        if not all(g is None or id(g) in prepared for g in grads):
            grads = prepare_gradients(self, grads, variables)
        parent = super().apply_gradients
        agg = aggregation_of(self)
        if agg is None:
            return parent(list(zip(grads, variables, strict=True)), *args, **kwargs)
        iterations = self.iterations  # created out here, not in a branch

        def apply_reduced():
            parent(list(zip(grads, variables, strict=True)), *args, **kwargs)

        agg.apply_when_ready(apply_reduced, lambda: iterations.assign_add(1))
        return iterations

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient local to this rank (divided by the number of ranks)."""
        register_local_var(self, var)


#: where each Keras applies gradients -> the class that reduces them there
_HOOKS: dict[str, type] = {"apply": Keras3Distributed, "apply_gradients": TfKerasDistributed}


def distributed_class(cls: type, hook: str, reduce: ReduceFn) -> type:
    """The cached subclass of optimizer class ``cls`` that reduces gradients in ``hook`` with ``reduce``.

    Args:
        cls: a Keras optimizer class.
        hook: ``"apply"`` (Keras 3's one entry for applying gradients) or
            ``"apply_gradients"`` (tf_keras's).
        reduce: the Keras backend's reduction function.

    Raises:
        ValueError: an unknown ``hook``.
    """
    key = (cls, hook, reduce)
    if key in _CLASSES:
        return _CLASSES[key]
    if hook not in _HOOKS:
        raise ValueError(f"unknown optimizer hook {hook!r}")

    class Distributed(_HOOKS[hook], cls):
        hora_reduce = staticmethod(reduce)

    Distributed.__name__ = cls.__name__
    Distributed.__qualname__ = cls.__qualname__
    Distributed.__module__ = cls.__module__
    Distributed.__doc__ = f"{cls.__name__} whose gradients hora reduces across ranks before they are applied."
    _CLASSES[key] = Distributed
    return Distributed


def make_distributed(optimizer: Any, *, hook: str, reduce: ReduceFn, reduction: GradientReduction,
                     name: str | None, backward_passes_per_step: int, average_aggregated_gradients: bool,
                     aggregation_ops: Callable[[], AggregationOps]) -> Any:
    """A copy of ``optimizer`` (same class and config, fresh state) that reduces its gradients across ranks.

    Args:
        optimizer: a Keras optimizer.
        hook: where its Keras applies gradients (see :func:`distributed_class`).
        reduce: the Keras backend's reduction function.
        reduction: the reduction's options, already checked.
        name: the copy's name (None keeps the optimizer's).
        backward_passes_per_step: reduce and apply every N steps, summing locally in between.
        average_aggregated_gradients: with N > 1, average the N steps' gradients instead of summing them.
        aggregation_ops: makes the tensor operations of the local aggregation (called only for N > 1).

    Raises:
        ValueError: ``backward_passes_per_step < 1``.
    """
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step={backward_passes_per_step} must be >= 1")
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    dist = distributed_class(type(optimizer), hook, reduce).from_config(config)
    attach_reduction(dist, reduction)
    if backward_passes_per_step > 1:
        attach_aggregation(dist, LocalAggregation(backward_passes_per_step, average_aggregated_gradients,
                                                  aggregation_ops()))
    return dist


def register_local_layers(optimizer: Any, local_layers: Any) -> Any:
    """Keep the gradients of the variables of ``local_layers`` (a layer or a list) local: PartialDistributedOptimizer.

    Returns:
        ``optimizer``.
    """
    layers = local_layers if isinstance(local_layers, list | tuple) else [local_layers] if local_layers else []
    for layer in layers:
        for var in layer.trainable_weights:
            register_local_var(optimizer, var)
    return optimizer


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


def reduced_gradients(optimizer: Any, grads: list[Any], variables: list[Any] | None) -> list[Any]:
    """The gradients reduced by the optimizer's backend reduction; local variables' are divided by the size instead."""
    reduce, reduction = optimizer.hora_reduce, reduction_of(optimizer)
    local = getattr(optimizer, "hora_local_vars", None)
    if not local or variables is None:
        return reduce(grads, variables, reduction)
    from hora.core import runtime

    idx = [i for i, v in enumerate(variables) if id(v) not in local]
    reduced = reduce([grads[i] for i in idx], [variables[i] for i in idx], reduction)
    out = [_scaled(g, 1.0 / runtime.current().engine.size) for g in grads]
    for i, r in zip(idx, reduced, strict=True):
        out[i] = r
    return out


def prepare_gradients(optimizer: Any, grads: list[Any], variables: list[Any]) -> list[Any]:
    """What the optimizer applies: the reduced gradients, or with ``backward_passes_per_step`` the
    accumulated ones, reduced on the step that applies them (see :mod:`hora._keras.aggregation`)."""
    agg = aggregation_of(optimizer)
    if agg is None:
        return reduced_gradients(optimizer, grads, variables)
    accumulated = agg.accumulate(grads, variables)
    present = [i for i, g in enumerate(accumulated) if g is not None]

    def reduce(values: list[Any]) -> list[Any]:
        return reduced_gradients(optimizer, values, [variables[i] for i in present])

    return agg.reduce_when_ready(accumulated, reduce)


def attach_aggregation(optimizer: Any, aggregation: LocalAggregation) -> None:
    """Give a distributed optimizer its :class:`~hora._keras.aggregation.LocalAggregation`.

    It is kept as ``_agg_helper`` too, the attribute Horovod's optimizers and
    tests read the step count from (``opt._agg_helper.counter``).
    """
    object.__setattr__(optimizer, "hora_aggregation", aggregation)
    object.__setattr__(optimizer, "_agg_helper", aggregation)


def aggregation_of(optimizer: Any) -> LocalAggregation | None:
    """The optimizer's local aggregation, or None when it reduces every step."""
    return getattr(optimizer, "hora_aggregation", None)


def reduction_of(optimizer: Any) -> GradientReduction:
    """The options of a distributed optimizer's reduction; Horovod's defaults for one Keras made itself
    (``from_config`` while loading a model)."""
    reduction = getattr(optimizer, "hora_reduction", None)
    if reduction is None:
        reduction = GradientReduction()
        attach_reduction(optimizer, reduction)
    return reduction


def attach_reduction(optimizer: Any, reduction: GradientReduction) -> None:
    """Give a distributed optimizer the reduction options built from ``DistributedOptimizer``'s arguments.

    A compressor state loaded before (``load_model`` reads the archive's
    assets before it attaches the compressor) goes to a stateful compressor now.
    """
    object.__setattr__(optimizer, "hora_reduction", reduction)
    pending = getattr(optimizer, "hora_pending_compression", None)
    if pending is not None and is_stateful(reduction.compression):
        reduction.compression.load_state_dict(pending)
        object.__setattr__(optimizer, "hora_pending_compression", None)


def compressor_of(optimizer: Any) -> Any:
    """The stateful compressor of a distributed optimizer, or None (stateless, or not distributed)."""
    reduction = getattr(optimizer, "hora_reduction", None)
    compression = reduction.compression if reduction is not None else None
    return compression if is_stateful(compression) else None


def load_model(load: Callable[..., Any], filepath: str, classes: dict[str, type],
               custom_objects: dict[str, Any] | None, reduction: GradientReduction, **kwargs: Any) -> Any:
    """``load(filepath, custom_objects=...)`` (a Keras's ``load_model``), its compiled optimizer made distributed.

    ``classes`` maps each optimizer class's name to its distributed class, so
    the saved optimizer's state (iterations, slots) is restored into the
    distributed one, which then reduces with ``reduction``.
    """
    objects = {**classes, **(custom_objects or {})}
    model = load(filepath, custom_objects=objects, **kwargs)
    opt = getattr(model, "optimizer", None)
    if opt is not None and is_distributed(opt):
        attach_reduction(opt, reduction)
    return model


def is_distributed(optimizer: Any) -> bool:
    """True for an optimizer made by ``DistributedOptimizer`` (or restored as one by ``load_model``)."""
    return isinstance(optimizer, Keras3Distributed | TfKerasDistributed)


__all__ = ["CompressionStateMixin", "Keras3Distributed", "ReduceFn", "TfKerasDistributed", "aggregation_of",
           "attach_aggregation", "attach_reduction", "compressor_of", "distributed_class", "is_distributed",
           "load_model", "make_distributed",
           "prepare_gradients", "reduced_gradients", "reduction_of", "register_local_layers", "register_local_var"]
