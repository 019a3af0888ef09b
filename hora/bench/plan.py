"""``hora bench plan``: the cost model's predictions for a cluster you do not have.

For W workers, a gradient payload and a link, it prints the ring-allreduce
time against a parameter server with 1, 2, 4, ... servers (and the count
asked for), each as bandwidth + latency + CPU terms, the ratio to the ring,
and, given a compute time per step, the scaling efficiency.  The seed's
64-GPU case::

    hora bench plan --workers 64 --servers 32 --link 25gbit --model-mb 100

With ``--compression`` (``fp16``, ``bf16``, ``powersgd:4``...) it adds the
ring allreduce of the compressed gradients: the bytes of each of the
compressor's allreduces (:mod:`hora.bench.compression`), plus its arithmetic
at ``--compress-gflops`` when given.  ``--gradients resnet50|vgg16|mlp``
takes a real model's parameter shapes (and its size); otherwise the payload
is taken as 1024 x 1024 float32 matrices.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from hora.bench.compression import Exchange, compressed_ring, exchange, gradient_set, square_matrices
from hora.bench.model import CostModel
from hora.bench.report import markdown_table
from hora.bench.units import MiB, fmt_bytes, fmt_rate, fmt_ratio, fmt_seconds
from hora.errors import ConfigError


@dataclasses.dataclass(kw_only=True, slots=True)
class PlanConfig:
    """The cluster and workload to predict.

    Attributes:
        workers: W.
        servers: the server count of interest (marked in the table); None: W.
        payload_bytes: gradient bytes exchanged per step.
        compute_s: compute time per step, for the efficiency column; None: no column.
        overlap: fraction of the exchange hidden behind compute, in [0, 1].
        colocated: servers share the workers' hosts (MXNet's launch.py) instead of their own.
        compression: a compressor spelling (``none``, ``fp16``, ``bf16``, ``powersgd:4``).
        gradients: a named gradient set (``resnet50``, ``vgg16``, ``mlp``); it sets the payload.
        compress_flops: flops per second of the compressor's arithmetic; ``inf`` leaves it out.
    """

    workers: int
    servers: int | None = None
    payload_bytes: int = 100 * MiB
    compute_s: float | None = None
    overlap: float = 0.0
    colocated: bool = False
    compression: str = "none"
    gradients: str | None = None
    compress_flops: float = math.inf

    def __post_init__(self) -> None:
        if self.gradients is not None:
            self.payload_bytes = int(sum(math.prod(s) for s in gradient_set(self.gradients)) * 4)
        if not self.compress_flops > 0:
            raise ConfigError(f"--compress-gflops must be > 0, got {self.compress_flops / 1e9:g}")
        if self.workers < 1:
            raise ConfigError(f"--workers {self.workers} must be >= 1")
        if self.servers is not None and self.servers < 1:
            raise ConfigError(f"--servers {self.servers} must be >= 1")
        if self.colocated and (self.servers or 0) > self.workers:
            raise ConfigError(f"--colocated puts one server per worker host: --servers {self.servers} is more "
                              f"than the {self.workers} workers")
        if self.payload_bytes <= 0:
            raise ConfigError(f"--model-mb must be > 0, got {self.payload_bytes / MiB:g}")
        if self.compute_s is not None and self.compute_s <= 0:
            raise ConfigError(f"--compute-ms must be > 0, got {self.compute_s * 1e3:g}")
        if not 0.0 <= self.overlap <= 1.0:
            raise ConfigError(f"--overlap {self.overlap} must be a fraction in [0, 1]")

    @property
    def server_counts(self) -> list[int]:
        """1, 2, 4, ... up to 2W (W with --colocated), plus the count asked for."""
        top = self.workers if self.colocated else 2 * self.workers
        counts, k = set(), 1
        while k <= top:
            counts.add(k)
            k *= 2
        counts.add(self.servers or self.workers)
        return sorted(c for c in counts if not self.colocated or c <= self.workers)


def predict(config: PlanConfig, model: CostModel) -> dict[str, Any]:
    """Rows for the ring and every server count, and a summary."""
    s, w = config.payload_bytes, config.workers
    ring = model.ring_allreduce(s, w)
    rows = [_row("ring allreduce", None, ring, ring.total, config, model)]
    for k in config.server_counts:
        est = model.ps_push_pull(s, w, k, config.colocated)
        rows.append(_row("parameter server", k, est, ring.total, config, model))
    compressed = None
    if config.compression != "none":
        ex = config_exchange(config)
        est = compressed_ring(model, ex, w, config.compress_flops)
        rows.insert(1, _row(f"ring allreduce, {ex.spec}", None, est, ring.total, config, model))
        compressed = {"spec": ex.spec, "time_s": est.total, "wire_bytes": ex.wire_bytes, "ratio": ex.ratio,
                      "allreduces": len(ex.rounds), "flops": ex.flops}
    match = model.servers_to_match_ring(s, w, tolerance=1.1, colocated=config.colocated)
    k = config.servers or w
    return {"rows": rows, "ring_s": ring.total, "servers": k,
            "ps_s": model.ps_push_pull(s, w, k, config.colocated).total,
            "servers_within_10pct_of_ring": match, "compressed": compressed}


def config_exchange(config: PlanConfig) -> Exchange:
    """The compressor's exchange of the configured gradients (a named set, or 1024 x 1024 matrices)."""
    shapes = gradient_set(config.gradients) if config.gradients else square_matrices(config.payload_bytes)
    return exchange(shapes, config.compression)


def _row(strategy: str, servers: int | None, est: Any, ring_s: float, config: PlanConfig,
         model: CostModel) -> dict[str, Any]:
    row = {"strategy": strategy, "servers": servers, "time_s": est.total, "bandwidth_s": est.bandwidth,
           "latency_s": est.latency, "cpu_s": est.cpu, "vs_ring": est.total / ring_s if ring_s else None,
           "requested": servers is not None and servers == (config.servers or config.workers)}
    if config.compute_s is not None:
        row["efficiency"] = model.scaling_efficiency(config.compute_s, est.total, config.overlap)
    return row


def render(config: PlanConfig, model: CostModel, result: dict[str, Any]) -> str:
    """The plan as a heading, a markdown table and a summary."""
    where = "servers on the workers' hosts" if config.colocated else "servers on hosts of their own"
    lines = [f"{config.workers} workers, {fmt_bytes(config.payload_bytes)} of gradients per step, "
             f"{fmt_rate(model.bandwidth_bps)} links, {model.latency_s * 1e6:g} µs latency, {where}."]
    if config.compute_s is not None:
        lines[0] += (f" Compute {config.compute_s * 1e3:g} ms per step, {100 * config.overlap:g}% of the exchange "
                     "hidden behind it.")
    headers = ["strategy", "servers", "time/step", "bandwidth", "latency", "cpu", "vs ring"]
    if config.compute_s is not None:
        headers.append("efficiency")
    body = []
    for r in result["rows"]:
        k = "—" if r["servers"] is None else f"{r['servers']}{' *' if r['requested'] else ''}"
        cells = [r["strategy"], k, fmt_seconds(r["time_s"]), fmt_seconds(r["bandwidth_s"]),
                 fmt_seconds(r["latency_s"]), fmt_seconds(r["cpu_s"]), fmt_ratio(r["vs_ring"])]
        if config.compute_s is not None:
            cells.append(f"{100 * r['efficiency']:.0f}%")
        body.append(cells)
    lines += ["", markdown_table(headers, body), ""]
    k, ps, ring = result["servers"], result["ps_s"], result["ring_s"]
    lines.append(f"* = the requested {k} servers: {fmt_seconds(ps)} per push+pull, {ps / ring:.2f}x the ring's "
                 f"{fmt_seconds(ring)}." if ring else f"* = the requested {k} servers.")
    match = result["servers_within_10pct_of_ring"]
    if match is None:
        best = min((r for r in result["rows"] if r["servers"] is not None), key=lambda r: (r["time_s"], r["servers"]))
        lines.append(f"No server count comes within 10% of the ring: at best {fmt_ratio(best['vs_ring'])}, from "
                     f"{best['servers']} servers on (a worker's link carries S each way, the ring's 2(N-1)/N*S).")
    else:
        lines.append(f"The parameter server comes within 10% of the ring from {match} servers "
                     f"({match / config.workers:.2g}x the workers) on.")
    comp = result.get("compressed")
    if comp is not None:
        cpu = ("" if math.isinf(config.compress_flops) else
               f", its arithmetic {comp['flops'] / 1e9:.3g} GFLOP at {config.compress_flops / 1e9:g} GFLOP/s")
        lines.append(f"{comp['spec']}: {fmt_bytes(comp['wire_bytes'])} on the wire in {comp['allreduces']} "
                     f"allreduce(s), {comp['ratio']:.3g}x fewer bytes{cpu}: {fmt_seconds(comp['time_s'])} per step, "
                     f"{comp['time_s'] / ring:.3g}x the uncompressed ring." if ring else f"{comp['spec']}.")
    lines.append("Model: ring 2(N-1)/N*S/B + 2(N-1)L; PS 2*max(S/B, N*S/(k*B)) + 4L (see hora.bench.model).")
    return "\n".join(lines)
