"""A step's gradients under a built-in cast (fp16, bf16), cast straight into one flat wire buffer and sent in chunks.

With a stateless cast the obvious path casts each gradient into a wire
tensor of its own and submits it; the engine then copies the small ones
into a fusion buffer, reduces, scales the result for Average, copies it
back, and the binding casts every tensor back: five passes over the bytes
and one collective per large tensor.  :class:`CastExchange` lays the
gradients out once, in a fixed order that is the same on every rank, in one
flat buffer of the wire dtype per device:

* each gradient is cast straight into its place as soon as it is ready (the
  cast is the fusion copy);
* a chunk of about ``chunk_bytes`` is submitted as one allreduce the moment
  its last gradient has been cast, so the casts of later chunks overlap the
  transfer of earlier ones, and the engine reduces it in its own memory
  (scaled there in the wire dtype, as a tensor of its own would be);
* :meth:`finish` casts each chunk back as it arrives, while the later ones
  are still on the wire.

The scale factors stay in the wire dtype, in place: a multiplication whose
output has another dtype than its input runs 5-10x slower in torch than the
cast alone (25 M elements: 35-77 ms against 6-8 ms), so a scale is never
fused into a cast.

The layout depends on the shapes and the order given, never on when the
gradients arrive, so every rank sums the same elements; the engine's
negotiation matches the chunks by name whatever order they are submitted in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from hora.core import collectives
from hora.core.buffers import ITEMSIZE, Array, ArrayOps, ops_for
from hora.core.compression.base import FLOAT_DTYPES
from hora.core.ops import CollectiveType, ReduceOp
from hora.core.request import Handle
from hora.errors import ConfigError

# The chunks are engine buffers already: no conversion on the way in or out.
_RAW = collectives.Adapter(to_buffer=None)

#: wire bytes per chunk by default: large enough that a chunk's per-collective latency is small
#: against its transfer, small enough that the casts of the next chunks overlap it (docs/benchmarks.md).
DEFAULT_CHUNK_BYTES = 8 << 20


@dataclasses.dataclass(slots=True)
class _Chunk:
    """One allreduce of the flat buffer: ``keys`` occupy ``[start, stop)``."""

    name: str
    flat: Array  # the chunk's view of its device's flat buffer
    keys: list[Hashable]
    left: int = 0  # gradients not cast yet this step
    handle: Handle | None = None


@dataclasses.dataclass(slots=True)
class _Slot:
    chunk: _Chunk
    view: Array  # the gradient's place in the flat buffer, in the gradient's shape


class CastExchange:
    """Casts gradients into a flat wire buffer in a fixed layout and allreduces it chunk by chunk.

    A binding builds one per optimizer with the gradients it will reduce
    (``keys`` with a template array of each gradient's shape, dtype and
    device, in an order every rank shares: the reverse of the parameters'
    order is the order backward usually makes them in), calls :meth:`add`
    from its gradient hook and :meth:`finish` before the optimizer steps.

    Args:
        wire_dtype: the dtype on the wire (``float16``, ``bfloat16``).
        keys: one hashable per gradient (the binding's parameter key).
        templates: arrays with each gradient's shape, dtype and device.
        names: each gradient's name, for the chunks' request names.
        op: Average or Sum.
        prescale: factor applied to the wire values before the reduction.
        postscale: factor applied to them after it.
        process_set: the set to reduce over (None: all ranks).
        chunk_bytes: wire bytes per allreduce; a gradient is never split.

    Raises:
        ConfigError: an op other than Average or Sum, a key that is not a
            floating gradient, or a non-positive ``chunk_bytes``.
    """

    def __init__(self, wire_dtype: str, keys: Sequence[Hashable], templates: Sequence[Array], names: Sequence[str],
                 *, op: ReduceOp = ReduceOp.AVERAGE, prescale: float = 1.0, postscale: float = 1.0,
                 process_set: Any = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        op = ReduceOp(op)
        if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
            raise ConfigError(f"a cast exchange reduces with Average or Sum, not {op.name}")
        if chunk_bytes <= 0:
            raise ConfigError(f"chunk_bytes={chunk_bytes} must be positive")
        self.wire_dtype = wire_dtype
        self._reduce = {"op": op, "prescale": float(prescale), "postscale": float(postscale),
                        "process_set": process_set}
        self._slots: dict[Hashable, _Slot] = {}
        self._chunks: list[_Chunk] = []
        self._ops: dict[Hashable, ArrayOps] = {}
        per_device: dict[Any, list[int]] = {}  # device -> positions, in the given order
        for i, t in enumerate(templates):
            ops = ops_for(t)
            if ops.dtype_name(t) not in FLOAT_DTYPES:
                raise ConfigError(f"gradient {names[i]!r} is {ops.dtype_name(t)}, not floating: it cannot be cast")
            per_device.setdefault((ops.family, ops.device(t)), []).append(i)
        item = ITEMSIZE[wire_dtype]
        for (_, device), positions in per_device.items():
            ops = ops_for(templates[positions[0]])
            sizes = [ops.numel(templates[i]) for i in positions]
            flat = ops.empty((sum(sizes),), wire_dtype, device)
            at, group, start = 0, [], 0
            for i, n in zip(positions, sizes, strict=True):
                group.append((i, at, n))
                at += n
                if (at - start) * item >= chunk_bytes or i == positions[-1]:
                    chunk = _Chunk(f"allreduce.cast.{names[group[0][0]]}..{names[group[-1][0]]}", flat[start:at],
                                   [keys[j] for j, _, _ in group])
                    for j, off, size in group:
                        view = ops.reshape(flat[off : off + size], ops.shape(templates[j]))
                        self._slots[keys[j]] = _Slot(chunk, view)
                        self._ops[keys[j]] = ops
                    self._chunks.append(chunk)
                    group, start = [], at
        self.reset()

    @property
    def chunk_names(self) -> list[str]:
        """The request names of the chunks, in layout order (one allreduce each per step)."""
        return [c.name for c in self._chunks]

    def covers(self, key: Hashable) -> bool:
        """True when ``key``'s gradient is one of this exchange's."""
        return key in self._slots

    @property
    def pending(self) -> bool:
        """True between the first :meth:`add` of a step and its :meth:`finish`."""
        return any(c.left < len(c.keys) for c in self._chunks)

    def added(self, key: Hashable) -> bool:
        """True when ``key``'s gradient has been cast this step."""
        return key in self._added

    def add(self, key: Hashable, grad: Array) -> None:
        """Cast ``grad`` into its place; submit its chunk when that was the last one of it.

        Raises:
            ConfigError: ``key`` was already added this step (a second
                backward before the step).
        """
        slot = self._slots[key]
        chunk = slot.chunk
        if key in self._added:
            raise ConfigError(f"gradient {key!r} of {chunk.name} was added twice in one step; finish() the step "
                              "before the next backward")
        self._added.add(key)
        self._ops[key].copy_(slot.view, grad)  # the cast and the fusion copy in one pass
        chunk.left -= 1
        if chunk.left == 0:
            self._submit(chunk)

    def finish(self, grad_of: Callable[[Hashable], Array | None]) -> None:
        """Cast and submit what was not added, then cast every result back into ``grad_of(key)`` as it arrives.

        Chunks are waited for in layout order; each is cast back while the
        later ones are still being reduced.  ``grad_of`` returns None for a
        gradient reduced elsewhere this step (a sparse one): it is sent as
        zeros and its result dropped.  Whatever happens (a rank lost, a
        mismatch), the exchange is ready for a new step afterwards.

        Raises:
            HoraError: what a chunk's collective raised (the engine's error).
        """
        try:
            for key, slot in self._slots.items():
                if key not in self._added:
                    grad = grad_of(key)
                    self.add(key, self._ops[key].zeros(self._ops[key].shape(slot.view), self.wire_dtype,
                                                       self._ops[key].device(slot.view)) if grad is None else grad)
            for chunk in self._chunks:
                chunk.handle.wait()
                for key in chunk.keys:
                    out = grad_of(key)
                    if out is not None:
                        self._ops[key].copy_(out, self._slots[key].view)
        finally:
            self.reset()

    def reset(self) -> None:
        """Forget this step's casts and collectives (after :meth:`finish`, or when they failed)."""
        self._added: set[Hashable] = set()
        for chunk in self._chunks:
            chunk.left = len(chunk.keys)
            chunk.handle = None

    def _submit(self, chunk: _Chunk) -> None:
        ops = self._ops[chunk.keys[0]]
        if ops.device_type(chunk.flat) == "cuda":
            from hora.core.buffers.torch_ops import wait_for_stream

            wait_for_stream([chunk.flat])
        chunk.handle = collectives.submit(CollectiveType.ALLREDUCE, [chunk.flat], name=chunk.name, inplace=True,
                                          adapter=_RAW, **self._reduce)


__all__ = ["DEFAULT_CHUNK_BYTES", "CastExchange"]
