"""Per-tensor state for stateful compressors: the step counter, the per-step check, save and load.

:class:`TensorStateCompressor` is the base of the built-in stateful
compressors.  It keeps the bookkeeping that every one needs, so that a
subclass only says how to lay a step's tensors out (:meth:`_build`), how to
exchange them (:meth:`_exchange`) and which arrays are its state.

Saved state records the rank and world size that saved it.  Residuals are
one rank's own memory of what it has not yet sent: loading them into another
rank, or after the world size changed (an elastic reset, rank 0's state
broadcast to everyone), would count them twice, so they then start from zero
on every rank, consistently.  State that is the same on every rank (PowerSGD's
warm-start factors, the step counter) is always taken.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Sequence
from typing import Any

from hora.core import runtime
from hora.core.buffers import Array, ArrayOps, ops_for
from hora.core.compression.base import StatefulCompressor
from hora.core.compression.exchange import check_in_step, tensor_digest
from hora.core.ops import ReduceOp

log = logging.getLogger(__name__)

#: state keys that are one rank's own (dropped when loaded on another rank or world size).
LOCAL_KEYS = frozenset({"residual"})


class TensorStateCompressor(StatefulCompressor):
    """Bookkeeping shared by the built-in stateful compressors; see the module docstring."""

    def __init__(self) -> None:
        self.step = 0
        self._signature: tuple[tuple[str, tuple[int, ...], str], ...] | None = None
        self._signature_digest = 0
        self._pending: dict[str, Any] | None = None

    # ------------------------------------------------------------------ the step
    def reduce(self, tensors: Sequence[Array], names: Sequence[str], *, op: ReduceOp = ReduceOp.AVERAGE,
               prescale: float = 1.0, postscale: float = 1.0, process_set: Any = None) -> None:
        """Reduce ``tensors`` in place across the process set (see :class:`StatefulCompressor`).

        Every step starts with :func:`~hora.core.compression.exchange.check_in_step`
        (one 16-byte allreduce), so that ranks whose compressors differ (in
        settings, in the tensors they reduce, or in the step counter after a
        state loaded or reset on some ranks only) fail together at once,
        instead of sending different collectives and waiting on each other.

        Raises:
            ConfigError: ``op`` is not Average or Sum.
            MismatchError: ranks differ in settings, tensors or step (raised on every rank).
        """
        self.check_op(op)
        if len(tensors) != len(names):
            raise ValueError(f"{len(tensors)} tensors given with {len(names)} names")
        if not tensors:
            return
        ops = ops_for(tensors[0])
        signature = tuple((n, tuple(ops.shape(t)), ops.dtype_name(t)) for n, t in zip(names, tensors, strict=True))
        if signature != self._signature:
            self._build(ops, tensors, list(names))
            self._signature = signature
            self._signature_digest = tensor_digest(signature)
        check_in_step({**self.settings(), "step": self.step}, signature, names[0], process_set,
                      tensors_digest=self._signature_digest)
        if self._pending is not None:
            self._apply(ops, self._pending)
            self._pending = None
        self._exchange(ops, tensors, ReduceOp(op), float(prescale), float(postscale), process_set)
        self.step += 1

    @abc.abstractmethod
    def _build(self, ops: ArrayOps, tensors: Sequence[Array], names: list[str]) -> None:
        """Lay out buffers for this list of tensors (called when the list changes; state starts empty)."""

    @abc.abstractmethod
    def _exchange(self, ops: ArrayOps, tensors: Sequence[Array], op: ReduceOp, prescale: float, postscale: float,
                  process_set: Any) -> None:
        """Reduce one step's tensors in place."""

    @abc.abstractmethod
    def _arrays(self) -> dict[str, dict[str, Array]]:
        """The live state arrays: ``{tensor name: {key: array view}}``."""

    # ------------------------------------------------------------ save and load
    def state_dict(self) -> dict[str, Any]:
        """``{'step', 'rank', 'size', 'settings', 'tensors': {name: {key: array copy}}}``."""
        engine = runtime.current().engine if runtime.is_initialized() else None
        tensors = {name: {k: ops_for(a).clone(a) for k, a in arrays.items()} for name, arrays in self._arrays().items()}
        if self._pending is not None:  # loaded but not yet applied: keep it
            tensors = {**self._pending.get("tensors", {}), **tensors}
        return {"step": self.step, "rank": engine.rank if engine else -1, "size": engine.size if engine else -1,
                "settings": self.settings(), "tensors": tensors}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a :meth:`state_dict`; the arrays are copied in at the next step (their tensors may not exist yet)."""
        self.step = int(state.get("step", 0))
        self._pending = state
        if self._signature is not None:
            # Laid out already: apply now, so that a state_dict() taken before the next step returns it.
            self._apply(None, state)
            self._pending = None

    def shared_state_dict(self) -> dict[str, Any]:
        """:meth:`state_dict` without the per-rank residuals: what a root rank sends to the others."""
        state = self.state_dict()
        state["tensors"] = {name: {k: a for k, a in arrays.items() if k not in LOCAL_KEYS}
                            for name, arrays in state["tensors"].items()}
        return state

    def load_shared_state_dict(self, state: dict[str, Any]) -> None:
        """Take a root's :meth:`shared_state_dict` and start every residual from zero.

        What ``broadcast_optimizer_state`` and an elastic sync do, so that all
        ranks agree on the step and the factors after a new rendezvous, and
        none carries memory of a world that is gone.
        """
        for arrays in self._arrays().values():
            for key, a in arrays.items():
                if key in LOCAL_KEYS:
                    ops_for(a).scale_(a, 0.0)
        self.load_state_dict(state)

    def reset(self) -> None:
        """Forget all state (residuals, factors, the step counter); the next step starts afresh."""
        self.step = 0
        self._signature = None
        self._pending = None

    def _apply(self, ops: ArrayOps | None, state: dict[str, Any]) -> None:
        engine = runtime.current().engine if runtime.is_initialized() else None
        own = engine is not None and state.get("rank") == engine.rank and state.get("size") == engine.size
        live = self._arrays()
        unknown = sorted(set(state.get("tensors", {})) - set(live))
        if unknown:
            log.warning("compression state for %d tensor(s) matches no tensor reduced here, e.g. %r: it was saved "
                        "under other names (another model, or parameters named differently) and is ignored",
                        len(unknown), unknown[0])
        for name, arrays in state.get("tensors", {}).items():
            for key, value in arrays.items():
                target = live.get(name, {}).get(key)
                if target is None:
                    continue
                if key in LOCAL_KEYS and not own:
                    target_ops = ops_for(target)
                    target_ops.scale_(target, 0.0)
                    continue
                target_ops = ops_for(target)
                if tuple(target_ops.shape(target)) != tuple(_shape(value)):
                    raise ValueError(f"saved compression state {key!r} of {name!r} has shape {tuple(_shape(value))}, "
                                     f"the tensor needs {tuple(target_ops.shape(target))}: the checkpoint is of "
                                     "another model or compressor setting")
                target_ops.copy_(target, _to_family(target, value))
        if not own and any(k in LOCAL_KEYS for a in state.get("tensors", {}).values() for k in a):
            log.info("compression residuals saved by rank %s of %s start from zero here", state.get("rank"),
                     state.get("size"))


def _shape(a: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in a.shape)


def _to_family(target: Array, value: Any) -> Array:
    """``value`` (a NumPy array or torch tensor from a checkpoint) as an array of ``target``'s family."""
    ops = ops_for(target)
    if ops.family == "torch" and type(value).__module__.split(".", 1)[0] != "torch":
        from hora.core.buffers.torch_ops import from_numpy

        return from_numpy(value)
    if ops.family == "numpy" and type(value).__module__.split(".", 1)[0] == "torch":
        from hora.core.buffers.torch_ops import host_numpy

        return host_numpy(value.detach().cpu())
    return value


__all__ = ["LOCAL_KEYS", "TensorStateCompressor"]
