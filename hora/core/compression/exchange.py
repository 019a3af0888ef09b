"""What every stateful compressor shares: fused flat layouts, chunked allreduces, and the settings check.

A compressor packs what it sends (gradients, casts, PowerSGD's factors) into
one flat buffer per dtype and device, described by a :class:`FlatLayout`,
and reduces it with :func:`allreduce_flat`: one request through the core's
entry point, cut into pieces no larger than the fusion threshold.

Before each step's exchange, :func:`check_in_step` compares a 4-byte
fingerprint of every rank's settings, step counter and tensor list in one
16-byte allreduce.  Ranks that differ there would send different collectives
(one plain, another PowerSGD's factors) and wait on each other until the
stall limit; instead every rank learns it at once and
:func:`check_settings` names what differs.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from hora.core import collectives, runtime
from hora.core.buffers import ITEMSIZE, Array, ArrayOps
from hora.core.objects import allgather_object
from hora.core.ops import CollectiveType, ReduceOp
from hora.errors import MismatchError

# The compressors' buffers are engine buffers already: no conversion on the way in or out.
_RAW = collectives.Adapter(to_buffer=None)


@dataclasses.dataclass(slots=True)
class FlatLayout:
    """Where each of a list of shapes sits in one flat buffer: ``offsets[i]`` to ``offsets[i] + sizes[i]``."""

    shapes: list[tuple[int, ...]]
    offsets: list[int]
    sizes: list[int]
    total: int

    @classmethod
    def of(cls, shapes: Sequence[Sequence[int]]) -> FlatLayout:
        """The consecutive layout of ``shapes``."""
        offsets, sizes, at = [], [], 0
        for shape in shapes:
            n = math.prod(shape)
            offsets.append(at)
            sizes.append(n)
            at += n
        return cls([tuple(s) for s in shapes], offsets, sizes, at)

    def view(self, ops: ArrayOps, flat: Array, i: int) -> Array:
        """Item ``i`` of ``flat`` as an array of its shape, sharing ``flat``'s memory."""
        return ops.reshape(flat[self.offsets[i] : self.offsets[i] + self.sizes[i]], self.shapes[i])

    def pack(self, ops: ArrayOps, sources: Sequence[Array], flat: Array) -> None:
        """Write ``sources`` (one per item, any dtype) into ``flat``."""
        if sources:
            ops.pack(sources, flat[: self.total])

    def unpack(self, ops: ArrayOps, flat: Array, outputs: Sequence[Array]) -> None:
        """Copy each item of ``flat`` into its output (cast to the output's dtype)."""
        if outputs:
            ops.unpack(flat[: self.total], outputs)


def allreduce_flat(flat: Array, ops: ArrayOps, name: str, *, op: ReduceOp = ReduceOp.SUM, prescale: float = 1.0,
                   postscale: float = 1.0, process_set: Any = None) -> None:
    """Allreduce the 1-D ``flat`` in place and wait: one request, in pieces of at most the fusion threshold.

    ``name`` must be the same on every rank and step (the engine then caches
    the request's id, so negotiating it costs one bit).
    """
    n = ops.numel(flat)
    if n == 0:
        return
    threshold = runtime.current().engine.config.fusion_threshold_bytes
    per = max(1, threshold // ITEMSIZE[ops.dtype_name(flat)])
    chunks = [flat[i : i + per] for i in range(0, n, per)]
    if ops.device_type(flat) == "cuda":
        from hora.core.buffers.torch_ops import wait_for_stream

        wait_for_stream(chunks)
    collectives.submit(CollectiveType.ALLREDUCE, chunks, name=name, op=op, prescale=prescale, postscale=postscale,
                       process_set=process_set, inplace=True, adapter=_RAW, wake=False).wait()


def set_size(process_set: Any) -> int:
    """Number of ranks in ``process_set`` (None: all ranks)."""
    size = None if process_set is None else process_set.size()
    return runtime.current().engine.size if size is None else int(size)


def tensor_digest(tensors: Sequence[tuple[str, tuple[int, ...], str]]) -> int:
    """A digest of a tensor list ``(name, shape, dtype)``, for :func:`fingerprint` (kept while the list holds)."""
    return zlib.crc32(repr([tuple(t) for t in tensors]).encode())


def fingerprint(settings: dict[str, Any], tensors: Sequence[tuple[str, tuple[int, ...], str]] | int) -> int:
    """A 31-bit digest of a compressor's settings (step included) and tensor list, the same on every platform.

    ``tensors`` may be given as its :func:`tensor_digest`.
    """
    start = tensors if isinstance(tensors, int) else tensor_digest(tensors)
    return zlib.crc32(repr(sorted(settings.items())).encode(), start) & 0x7FFFFFFF


def check_in_step(settings: dict[str, Any], tensors: Sequence[tuple[str, tuple[int, ...], str]], tag: str,
                  process_set: Any = None, tensors_digest: int | None = None) -> None:
    """Check that every rank's compressor is in the same state before a step's exchange; raise on every rank if not.

    One allreduce (Max) of ``[d, -d]``, with ``d`` the :func:`fingerprint`
    of the arguments: the ranks agree exactly when the result is ``[d,
    -d]``, and every rank sees the same result, so all of them raise
    together.  Only then are the details gathered, by :func:`check_settings`.
    ``tensors_digest`` is :func:`tensor_digest` of ``tensors``, which a caller may keep.

    Raises:
        MismatchError: names the first tensor affected, what differs (a
            setting, the step counter, a tensor) and each rank's value.
    """
    d = fingerprint(settings, tensors if tensors_digest is None else tensors_digest)
    pair = np.array([d, -d], np.int64)
    collectives.submit(CollectiveType.ALLREDUCE, [pair], name=f"compression.fingerprint.{tag}", op=ReduceOp.MAX,
                       process_set=process_set, inplace=True, adapter=_RAW).wait()
    if pair[0] == -pair[1]:
        return
    check_settings(settings, tensors, tag, process_set)
    raise MismatchError(f"ranks' gradient compressors differ in state at tensor {tensors[0][0] if tensors else tag!r} "
                        "(their digests differ, though settings, step and tensor list print alike); "
                        "create them alike and load the same state on every rank")


def check_settings(settings: dict[str, Any], tensors: Sequence[tuple[str, tuple[int, ...], str]], tag: str,
                   process_set: Any = None) -> None:
    """Compare a compressor's settings and tensor list across the process set; raise on every rank if they differ.

    It costs one object allgather: :func:`check_in_step` calls it only once
    the ranks are known to differ.  ``tensors`` are ``(name, shape, dtype)``
    in the order reduced.  A ``step`` entry in ``settings`` is the step
    counter, whose difference means a state loaded or reset on some ranks only.

    Raises:
        MismatchError: names the first tensor affected, the setting and each rank's value.
    """
    gathered = allgather_object((settings, list(tensors)), name=f"compression.check.{tag}", process_set=process_set)
    ranks = process_set.ranks if process_set is not None and process_set.ranks is not None else range(len(gathered))
    ranks = list(ranks)
    first = gathered[0][1][0][0] if gathered[0][1] else "?"
    for key in sorted({k for s, _ in gathered for k in s}):
        values = [s.get(key) for s, _ in gathered]
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in zip(ranks, values, strict=True))
            if key == "step":
                raise MismatchError(
                    f"ranks' gradient compressors are at different steps for tensor {first!r} ({per_rank}): its "
                    "state (step counter, warm-start factors) was loaded or reset on some ranks only, so they would "
                    "send different collectives. Load the same checkpoint on every rank (optimizer.load_state_dict), "
                    "or give every rank the root's state with hvd.broadcast_optimizer_state(optimizer, root_rank=0) "
                    "(the optimizer's sync_compression)")
            raise MismatchError(
                f"ranks disagree on the gradient compressor for tensor {first!r}: setting {key!r} is {per_rank}; "
                "pass the same compression= on every rank")
    lengths = [len(t) for _, t in gathered]
    for i in range(max(lengths)):
        items = [t[i] if i < len(t) else None for _, t in gathered]
        if any(it != items[0] for it in items):
            name = next(it[0] for it in items if it is not None)
            per_rank = ", ".join(f"rank {r}: {it[1:] if it else 'absent'}" for r, it in zip(ranks, items, strict=True))
            raise MismatchError(
                f"ranks reduce different gradients through the compressor at tensor {name!r} "
                f"(position {i}; shape and dtype per rank: {per_rank}); every rank must reduce the same parameters")


__all__ = ["FlatLayout", "allreduce_flat", "check_in_step", "check_settings", "fingerprint", "set_size",
           "tensor_digest"]
