"""What gradient compression does to an exchange, for the cost model: bytes on the wire and the compressor's work.

A compressor turns one allreduce of ``S`` bytes into:

* ``none``: one allreduce of ``S``;
* ``fp16``, ``bf16`` (with or without error feedback): one allreduce of ``S/2``;
* ``powersgd:r``: two allreduces one after the other.  Each ``n x m``
  matrix that is compressed (see :func:`hora.core.compression.powersgd.matrix_rank`)
  sends ``n*r`` floats in the first (P, with the uncompressed tensors) and
  ``m*r`` in the second (Q).  Its arithmetic is about ``6*n*m*r`` flops (M Q,
  M^T P, P Q^T) plus the orthogonalization of P (``2*n*r^2``).

The gradient sets are the shapes of real models' parameters, so the
matrices are the ones PowerSGD would see: ``resnet50`` (161 tensors,
97.5 MiB), ``vgg16`` (32 tensors, 138 M parameters, most of them in two
fully connected layers) and ``mlp`` (784-1024-1024-10).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

from hora.bench.model import CostModel, Estimate
from hora.core.compression import parse_spec
from hora.core.compression.powersgd import PowerSGD, matrix_rank
from hora.errors import ConfigError

Shape = tuple[int, ...]


def _conv_bn(out: int, inp: int, k: int) -> list[Shape]:
    return [(out, inp, k, k), (out,), (out,)]


def resnet50_shapes() -> list[Shape]:
    """ResNet-50's 161 parameter shapes (torchvision's layout: conv, then its batch norm's weight and bias)."""
    shapes = _conv_bn(64, 3, 7)
    inp = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += _conv_bn(width, inp, 1) + _conv_bn(width, width, 3) + _conv_bn(width * 4, width, 1)
            if b == 0:
                shapes += _conv_bn(width * 4, inp, 1)  # the projection shortcut
            inp = width * 4
    return shapes + [(1000, 2048), (1000,)]


def vgg16_shapes() -> list[Shape]:
    """VGG16's 32 parameter shapes (13 convolutions and 3 fully connected layers, each with a bias)."""
    shapes, inp = [], 3
    for out in (64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512):
        shapes += [(out, inp, 3, 3), (out,)]
        inp = out
    return shapes + [(4096, 512 * 7 * 7), (4096,), (4096, 4096), (4096,), (1000, 4096), (1000,)]


def mlp_shapes() -> list[Shape]:
    """The MLP 784-1024-1024-10's 6 parameter shapes."""
    return [(1024, 784), (1024,), (1024, 1024), (1024,), (10, 1024), (10,)]


GRADIENT_SETS = {"resnet50": resnet50_shapes, "vgg16": vgg16_shapes, "mlp": mlp_shapes}


def gradient_set(name: str) -> list[Shape]:
    """The parameter shapes of a named model.

    Raises:
        ConfigError: an unknown name; the message lists the known ones.
    """
    try:
        return GRADIENT_SETS[name]()
    except KeyError:
        raise ConfigError(f"--gradients {name!r}: choose from {', '.join(GRADIENT_SETS)}") from None


def square_matrices(nbytes: float, side: int = 1024) -> list[Shape]:
    """A payload of ``nbytes`` float32 as ``side x side`` matrices (the shape assumed when none is given)."""
    count = max(1, round(nbytes / (4 * side * side)))
    return [(side, side)] * count


@dataclasses.dataclass(frozen=True, slots=True)
class Exchange:
    """One step's gradient exchange under a compressor.

    Attributes:
        spec: the compressor's spelling (``powersgd:4``).
        rounds: bytes of each allreduce, in the order they run (one after another).
        flops: the compressor's arithmetic per step on one rank.
        full_bytes: the uncompressed payload.
    """

    spec: str
    rounds: tuple[float, ...]
    flops: float
    full_bytes: float

    @property
    def wire_bytes(self) -> float:
        """Bytes reduced per step, all rounds together."""
        return sum(self.rounds)

    @property
    def ratio(self) -> float:
        """How many times fewer bytes than uncompressed."""
        return self.full_bytes / self.wire_bytes if self.wire_bytes else math.inf


def exchange(shapes: Sequence[Shape], spec: str, itemsize: int = 4) -> Exchange:
    """The allreduces and arithmetic of one step of ``shapes`` (float32) under the compressor ``spec``.

    Raises:
        ConfigError: an unknown compressor spelling.
    """
    try:
        compressor = parse_spec(spec)
    except ValueError as e:
        raise ConfigError(f"--compression {spec!r}: {e}") from None
    full = float(sum(math.prod(s) for s in shapes) * itemsize)
    if isinstance(compressor, PowerSGD):
        p = q = flops = 0.0
        for shape in shapes:
            r = matrix_rank(shape, compressor.rank, compressor.min_compression_rate)
            if not r:
                p += math.prod(shape)
                continue
            n, m = shape[0], math.prod(shape[1:])
            p += n * r
            q += m * r
            flops += 6.0 * n * m * r + 2.0 * n * r * r
        return Exchange(spec, (p * itemsize, q * itemsize), flops, full)
    wire = getattr(compressor, "wire_dtype", None)
    if wire in ("float16", "bfloat16"):
        return Exchange(spec, (full / 2,), full / itemsize, full)  # one cast per element
    return Exchange(spec, (full,), 0.0, full)


def compressed_ring(model: CostModel, ex: Exchange, workers: int, flops_per_s: float = math.inf) -> Estimate:
    """Ring allreduces of ``ex``'s rounds, one after another, plus the compressor's arithmetic as CPU time."""
    parts = [model.ring_allreduce(b, workers) for b in ex.rounds]
    return Estimate(bandwidth=sum(p.bandwidth for p in parts), latency=sum(p.latency for p in parts),
                    cpu=sum(p.cpu for p in parts) + ex.flops / flops_per_s,
                    shared=sum(p.shared for p in parts))


def measure_matmul_flops(n: int = 1024, r: int = 4, repeats: int = 5) -> float:
    """Flops per second of this host's NumPy on PowerSGD's products (an ``n x n`` by ``n x r``), best of ``repeats``."""
    import numpy as np

    m = np.ones((n, n), np.float32)
    q = np.ones((n, r), np.float32)
    out = np.empty((n, r), np.float32)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.matmul(m, q, out=out)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n * n * r / best


__all__ = ["Exchange", "GRADIENT_SETS", "compressed_ring", "exchange", "gradient_set", "measure_matmul_flops",
           "mlp_shapes", "resnet50_shapes", "square_matrices", "vgg16_shapes"]
