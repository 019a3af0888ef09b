"""PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019): gradients sent as rank-r factors P and Q.

A gradient of two or more dimensions is viewed as an ``n x m`` matrix M
(a conv kernel as out x rest).  With the previous step's ``m x r`` factor
Q (warm start), each rank computes ``P = M Q``; the P of all ranks are
summed, orthonormalized, and each rank computes ``Q = M^T P``; the Q are
averaged, and ``P Q^T`` approximates the average of the M.  With error
feedback, each rank keeps ``M - P Q^T`` and adds it to its next gradient.

How it runs here:

* Matrices of one shape form a *batch*, a stack ``(B, n, m)``: the
  products, the orthonormalization and the residuals are a few batched
  calls per shape, not per tensor.
* All of a step's P (and the uncompressed tensors: vectors, and matrices
  too small to gain ``min_compression_rate``) travel in one flat buffer,
  then all Q in another: two allreduces per step and dtype, cut only at the
  fusion threshold.  P and Q are computed straight into those buffers.
* Before ``start_step`` every tensor travels uncompressed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from hora.core.buffers import Array, ArrayOps, ops_for
from hora.core.compression.exchange import FlatLayout, allreduce_flat, set_size
from hora.core.compression.feedback import group_tensors
from hora.core.compression.state import TensorStateCompressor
from hora.core.ops import ReduceOp
from hora.errors import ConfigError

#: dtypes PowerSGD factors; the others (half precision, integers) travel uncompressed.
_MATRIX_DTYPES = frozenset({"float32", "float64"})

#: a batch of at least this many elements writes its approximation straight into its gradients instead of
#: into a scratch stack: VGG16's 4096 x 25088 layer would otherwise keep a second 392 MiB copy per rank.
DIRECT_ELEMENTS = 1 << 22


@dataclasses.dataclass(slots=True)
class _Batch:
    """Matrices of one shape ``n x m`` and rank ``r``: their stacks and where their factors sit."""

    index: list[int]  # positions in the step's tensor list
    names: list[str]
    shapes: list[tuple[int, ...]]
    n: int
    m: int
    r: int
    p_offset: int
    q_offset: int
    memory: Array | None = None  # (B, n, m): the residual with error feedback, else this step's matrices
    direct: bool = False  # large: the approximation goes straight into the gradients (no scratch)

    @property
    def count(self) -> int:
        return len(self.index)

    def p(self, flat: Array, ops: ArrayOps) -> Array:
        return ops.reshape(flat[self.p_offset : self.p_offset + self.count * self.n * self.r],
                           (self.count, self.n, self.r))

    def qt(self, flat: Array, ops: ArrayOps) -> Array:
        # Q is kept transposed, (r, m) per matrix: every product then reads M row by row (M^T P with M
        # transposed took 45x longer than P^T M in torch's batched matmul at rank 2, VGG16's 4096 x 25088).
        return ops.reshape(flat[self.q_offset : self.q_offset + self.count * self.m * self.r],
                           (self.count, self.r, self.m))


@dataclasses.dataclass(slots=True)
class _Group:
    """The step's tensors of one dtype and device."""

    dtype: str
    device: Any
    batches: list[_Batch]
    plain: list[int]
    plain_names: list[str]
    plain_layout: FlatLayout
    p_total: int
    q_total: int
    pflat: Array  # all P, then the uncompressed tensors
    qflat: Array  # all Q (kept between steps: the warm start)
    scratch: Array | None  # error feedback: room for the largest batch's approximation
    tag: str
    q_ready: bool = False


def matrix_rank(shape: Sequence[int], rank: int, min_compression_rate: float) -> int:
    """The rank a tensor of ``shape`` is compressed at, or 0 when it travels uncompressed.

    A tensor of two or more dimensions is an ``n x m`` matrix with ``n =
    shape[0]``; its rank is ``min(rank, n, m)``, and it is compressed when
    ``n * m`` is more than ``min_compression_rate`` times ``(n + m) * r``.
    """
    if len(shape) < 2:
        return 0
    n, m = int(shape[0]), math.prod(int(d) for d in shape[1:])
    r = min(rank, n, m)
    if r < 1 or not (n + m) * r * min_compression_rate < n * m:
        return 0
    return r


class PowerSGD(TensorStateCompressor):
    """PowerSGD gradient compression with warm start and error feedback.

    Args:
        rank: the rank of the approximation (clipped to each matrix's size).
        start_step: steps before this one are reduced uncompressed (plain allreduce).
        min_compression_rate: a matrix is compressed only when it shrinks at
            least this many times; 0 compresses every matrix.
        warm_start: reuse the previous step's Q instead of a new random one.
        error_feedback: keep each rank's approximation error for its next step.
        seed: seeds the random initial Q, the same on every rank.

    Raises:
        ConfigError: an argument out of range (the message names it).
    """

    def __init__(self, rank: int = 1, start_step: int = 0, min_compression_rate: float = 2.0,
                 warm_start: bool = True, error_feedback: bool = True, seed: int = 0) -> None:
        super().__init__()
        if int(rank) < 1:
            raise ConfigError(f"powersgd rank={rank} must be >= 1")
        if int(start_step) < 0:
            raise ConfigError(f"powersgd start_step={start_step} must be >= 0")
        if float(min_compression_rate) < 0:
            raise ConfigError(f"powersgd min_compression_rate={min_compression_rate} must be >= 0")
        self.rank = int(rank)
        self.start_step = int(start_step)
        self.min_compression_rate = float(min_compression_rate)
        self.warm_start = bool(warm_start)
        self.error_feedback = bool(error_feedback)
        self.seed = int(seed)
        self._groups: list[_Group] = []

    def settings(self) -> dict[str, Any]:
        """The options, which every rank must share."""
        return {"kind": "powersgd", "rank": self.rank, "start_step": self.start_step,
                "min_compression_rate": self.min_compression_rate, "warm_start": self.warm_start,
                "error_feedback": self.error_feedback, "seed": self.seed}

    # ---------------------------------------------------------------- layout
    def _build(self, ops: ArrayOps, tensors: Sequence[Array], names: list[str]) -> None:
        self._groups = []
        for (dtype, device), index in group_tensors(ops, tensors).items():
            by_shape: dict[tuple[int, int, int], list[int]] = {}
            plain: list[int] = []
            for i in index:
                shape = ops.shape(tensors[i])
                r = matrix_rank(shape, self.rank, self.min_compression_rate) if dtype in _MATRIX_DTYPES else 0
                if r:
                    by_shape.setdefault((int(shape[0]), ops.numel(tensors[i]) // int(shape[0]), r), []).append(i)
                else:
                    plain.append(i)
            batches, p_at, q_at, biggest = [], 0, 0, 0
            for (n, m, r), members in by_shape.items():
                b = _Batch(members, [names[i] for i in members], [tuple(ops.shape(tensors[i])) for i in members],
                           n, m, r, p_at, q_at)
                b.memory = ops.zeros([b.count, n, m], dtype, device)
                b.direct = b.count * n * m >= DIRECT_ELEMENTS
                batches.append(b)
                p_at += b.count * n * r
                q_at += b.count * m * r
                if not b.direct:
                    biggest = max(biggest, b.count * n * m)
            plain_layout = FlatLayout.of([ops.shape(tensors[i]) for i in plain])
            self._groups.append(_Group(
                dtype, device, batches, plain, [names[i] for i in plain], plain_layout, p_at, q_at,
                ops.empty([p_at + plain_layout.total], dtype, device), ops.zeros([q_at], dtype, device),
                ops.empty([biggest], dtype, device) if self.error_feedback and biggest else None,
                f"{names[index[0]]}..{names[index[-1]]}",
            ))

    def _arrays(self) -> dict[str, dict[str, Array]]:
        out: dict[str, dict[str, Array]] = {}
        for g in self._groups:
            if not g.batches:
                continue
            ops = ops_for(g.qflat)
            for b in g.batches:
                qs = b.qt(g.qflat, ops)
                mem = b.memory
                for j, name in enumerate(b.names):
                    entry = {"q": qs[j]}  # Q transposed: (rank, m)
                    if self.error_feedback:
                        entry["residual"] = ops.reshape(mem[j], b.shapes[j])  # saved in the gradient's shape
                    out[name] = entry
        return out

    def _apply(self, ops: ArrayOps | None, state: dict[str, Any]) -> None:
        super()._apply(ops, state)
        saved = state.get("tensors", {})
        for g in self._groups:
            # A loaded Q is the warm start: drawing a new random one would discard it.
            if g.batches and all("q" in saved.get(name, {}) for b in g.batches for name in b.names):
                g.q_ready = True

    # ------------------------------------------------------------------ step
    def _exchange(self, ops: ArrayOps, tensors: Sequence[Array], op: ReduceOp, prescale: float, postscale: float,
                  process_set: Any) -> None:
        for g in self._groups:
            if self.step < self.start_step or not g.batches:
                self._plain(ops, g, tensors, op, prescale, postscale, process_set)
            else:
                self._compressed(ops, g, tensors, op, prescale, postscale, process_set)

    def _plain(self, ops: ArrayOps, g: _Group, tensors: Sequence[Array], op: ReduceOp, prescale: float,
               postscale: float, process_set: Any) -> None:
        """Every tensor of the group uncompressed, in one flat allreduce (the P buffer is reused as room)."""
        parts = [t for b in g.batches for t in (tensors[i] for i in b.index)] + [tensors[i] for i in g.plain]
        total = sum(ops.numel(t) for t in parts)
        flat = g.pflat if ops.numel(g.pflat) >= total else ops.empty([total], g.dtype, g.device)
        ops.pack(parts, flat[:total])
        allreduce_flat(flat[:total], ops, f"compression.powersgd{self.rank}.plain.{g.tag}", op=op, prescale=prescale,
                       postscale=postscale, process_set=process_set)
        ops.unpack(flat[:total], parts)

    def _compressed(self, ops: ArrayOps, g: _Group, tensors: Sequence[Array], op: ReduceOp, prescale: float,
                    postscale: float, process_set: Any) -> None:
        if not g.q_ready or not self.warm_start:
            # The same seed on every rank: the ranks' P = M Q must share one Q to be summed.
            ops.copy_(g.qflat, ops.random_normal([g.q_total], g.dtype, g.device,
                                                 self.seed + (0 if self.warm_start else self.step)))
            g.q_ready = True
        for b in g.batches:
            # With error feedback the memory holds last step's residual: M = gradient + residual.
            ops.stack_([tensors[i] for i in b.index], b.memory, accumulate=self.error_feedback)
            ops.matmul_(b.memory, b.qt(g.qflat, ops), b.p(g.pflat, ops), transpose_b=True)
        plain = [tensors[i] for i in g.plain]
        tail = g.pflat[g.p_total:]
        g.plain_layout.pack(ops, plain, tail)
        # The P ride with the uncompressed tensors under the caller's op and scales: scaling a P changes
        # nothing, since it is orthonormalized next.
        allreduce_flat(g.pflat, ops, f"compression.powersgd{self.rank}.P.{g.tag}", op=op, prescale=prescale,
                       postscale=postscale, process_set=process_set)
        g.plain_layout.unpack(ops, tail, plain)
        for b in g.batches:
            p = b.p(g.pflat, ops)
            ops.orthonormalize_(p)
            ops.matmul_(p, b.memory, b.qt(g.qflat, ops), transpose_a=True)  # Q^T = P^T M
        allreduce_flat(g.qflat, ops, f"compression.powersgd{self.rank}.Q.{g.tag}", op=ReduceOp.AVERAGE,
                       process_set=process_set)
        factor = prescale * postscale * (set_size(process_set) if op == ReduceOp.SUM else 1)
        for b in g.batches:
            # P Q^T approximates the average of the ranks' M; the residual is what of this rank's M it misses.
            if self.error_feedback and b.direct:
                self._approximate_into(ops, b, g, [tensors[i] for i in b.index], factor)
                continue
            if self.error_feedback:
                approx = ops.reshape(g.scratch[: b.count * b.n * b.m], (b.count, b.n, b.m))
            else:
                approx = b.memory  # not needed any more: the approximation overwrites it
            ops.matmul_(b.p(g.pflat, ops), b.qt(g.qflat, ops), approx)
            if self.error_feedback:
                ops.add_(b.memory, approx, alpha=-1.0)
            ops.unstack_(approx, [tensors[i] for i in b.index], factor)

    @staticmethod
    def _approximate_into(ops: ArrayOps, b: _Batch, g: _Group, outputs: list[Array], factor: float) -> None:
        """A large batch: each P Q^T is written into its gradient, subtracted from the residual, then scaled.

        One product per matrix (these batches hold one or a few large
        matrices, so the loop is short), and no scratch stack the size of the
        batch.
        """
        p, qt = b.p(g.pflat, ops), b.qt(g.qflat, ops)
        for j, out in enumerate(outputs):
            view = ops.reshape(out, (b.n, b.m)) if ops.is_contiguous(out) else ops.empty([b.n, b.m], g.dtype, g.device)
            ops.matmul_(p[j], qt[j], view)
            ops.add_(b.memory[j], view, alpha=-1.0)
            ops.scale_(view, factor)
            if not ops.is_contiguous(out):
                ops.copy_(out, ops.reshape(view, b.shapes[j]))


__all__ = ["DIRECT_ELEMENTS", "PowerSGD", "matrix_rank"]
