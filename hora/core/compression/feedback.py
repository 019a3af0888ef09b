"""Error feedback for a lossy cast (``Compression.fp16.with_error_feedback()``).

Each rank adds what the cast lost on its previous step to its gradient
before casting again, so over a run the sum of what a rank sent plus its
current residual equals the sum of its true gradients: nothing is lost for
good, only delayed.  A step's gradients of one dtype travel as one flat
buffer (cut at the fusion threshold), so the arithmetic is a handful of
whole-buffer operations, whatever the number of tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from hora.core.buffers import Array, ArrayOps, ops_for
from hora.core.compression.base import FLOAT_DTYPES
from hora.core.compression.exchange import FlatLayout, allreduce_flat
from hora.core.compression.state import TensorStateCompressor
from hora.core.ops import ReduceOp
from hora.errors import ConfigError


@dataclasses.dataclass(slots=True)
class _Group:
    """The step's tensors of one dtype and device, laid out in one flat buffer."""

    index: list[int]
    names: list[str]
    layout: FlatLayout
    wire: Array  # what travels (the wire dtype)
    residual: Array | None  # flat, the tensors' dtype; None when nothing is lost (no cast)
    scratch: Array | None


def group_tensors(ops: ArrayOps, tensors: Sequence[Array]) -> dict[tuple[str, Any], list[int]]:
    """Indices of ``tensors`` by (dtype, device), in first-seen order."""
    groups: dict[tuple[str, Any], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((ops.dtype_name(t), ops.device(t)), []).append(i)
    return groups


class ErrorFeedback(TensorStateCompressor):
    """A cast to ``wire_dtype`` with per-tensor error-feedback residuals.

    Args:
        wire_dtype: ``float16`` or ``bfloat16`` (None: no cast, nothing lost, no residual).
        label: the cast's name in settings and messages.
    """

    def __init__(self, wire_dtype: str | None, label: str = "cast") -> None:
        super().__init__()
        if wire_dtype not in (None, "float16", "bfloat16"):
            raise ConfigError(f"error feedback wraps a float16 or bfloat16 cast, not {wire_dtype!r}")
        self.wire_dtype = wire_dtype
        self.label = label
        self._groups: list[_Group] = []

    def settings(self) -> dict[str, Any]:
        """The cast and the kind; every rank must share them."""
        return {"kind": "error_feedback", "wire_dtype": self.wire_dtype}

    def __repr__(self) -> str:
        return f"{self.label}.with_error_feedback()"

    def _build(self, ops: ArrayOps, tensors: Sequence[Array], names: list[str]) -> None:
        self._groups = []
        for (dtype, device), index in group_tensors(ops, tensors).items():
            layout = FlatLayout.of([ops.shape(tensors[i]) for i in index])
            lossy = self.wire_dtype is not None and dtype in FLOAT_DTYPES and dtype != self.wire_dtype
            wire = ops.empty([layout.total], self.wire_dtype if lossy else dtype, device)
            residual = ops.zeros([layout.total], dtype, device) if lossy else None
            scratch = ops.empty([layout.total], dtype, device) if lossy else None
            self._groups.append(_Group(index, [names[i] for i in index], layout, wire, residual, scratch))

    def _exchange(self, ops: ArrayOps, tensors: Sequence[Array], op: ReduceOp, prescale: float, postscale: float,
                  process_set: Any) -> None:
        for g in self._groups:
            parts = [tensors[i] for i in g.index]
            if g.residual is None:
                g.layout.pack(ops, parts, g.wire)
            else:
                g.layout.pack(ops, parts, g.scratch)
                ops.add_(g.residual, g.scratch)  # the residual now holds gradient + what was lost before
                ops.copy_(g.wire, g.residual)  # the cast
                ops.add_(g.residual, g.wire, alpha=-1.0)  # what this cast loses, kept for the next step
            allreduce_flat(g.wire, ops, f"compression.ef.{g.names[0]}..{g.names[-1]}", op=op, prescale=prescale,
                           postscale=postscale, process_set=process_set)
            g.layout.unpack(ops, g.wire, parts)

    def _arrays(self) -> dict[str, dict[str, Array]]:
        out: dict[str, dict[str, Array]] = {}
        for g in self._groups:
            if g.residual is not None:
                ops = ops_for(g.residual)
                for i, name in enumerate(g.names):
                    out[name] = {"residual": g.layout.view(ops, g.residual, i)}
        return out


__all__ = ["ErrorFeedback", "group_tensors"]
