"""``hora bench allreduce``: hora's allreduce over sizes x backends x rank counts.

One ``hora run -np N --gloo|--mpi`` job per (backend, N) runs
:mod:`hora.bench.workers.allreduce` over all sizes.  For each size the time
is the median over iterations of the slowest rank; from it::

    algbw = S / t                 busbw = algbw * 2(N-1)/N

(bus bandwidth, as NCCL's tests define it, is comparable with the link rate
whatever ``N``), next to the cost model's ring time and measured/model.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

from hora.bench.emulate import Placement
from hora.bench.jobs import JobOutput, run_job
from hora.bench.model import CostModel, bus_bandwidth
from hora.bench.options import RunOptions, ratio
from hora.bench.report import Progress, markdown_table, with_runs
from hora.bench.units import fmt_bytes, fmt_ratio, fmt_seconds
from hora.errors import ConfigError

BACKENDS = ("gloo", "mpi")


@dataclasses.dataclass(kw_only=True, slots=True)
class AllreduceConfig:
    """What ``hora bench allreduce`` measures.

    Attributes:
        sizes: message sizes in bytes (multiples of 4: float32).
        backends: hora controllers, ``gloo`` and/or ``mpi``.
        num_procs: rank counts, one job per count and backend.
        iters: timed allreduces per size.
        warmup: untimed allreduces per size first.
    """

    sizes: Sequence[int]
    backends: Sequence[str] = BACKENDS
    num_procs: Sequence[int] = (2,)
    iters: int = 10
    warmup: int = 2

    def __post_init__(self) -> None:
        if not self.sizes or any(s <= 0 or s % 4 for s in self.sizes):
            raise ConfigError(f"--sizes {list(self.sizes)}: each must be a positive multiple of 4 bytes (float32)")
        bad = [b for b in self.backends if b not in BACKENDS]
        if bad or not self.backends:
            raise ConfigError(f"--backends {','.join(self.backends)}: choose from {', '.join(BACKENDS)}")
        if not self.num_procs or any(n < 1 for n in self.num_procs):
            raise ConfigError(f"-np {list(self.num_procs)}: every rank count must be >= 1")
        if self.iters < 1 or self.warmup < 0:
            raise ConfigError(f"need --iters >= 1 and --warmup >= 0, got {self.iters} and {self.warmup}")


def slowest_rank_median(results: dict[int, dict[str, Any]], key: str) -> tuple[float, float]:
    """(median, min) over iterations of the slowest rank's time for ``key``.

    Raises:
        ConfigError: the ranks reported different numbers of iterations.
    """
    per_rank = [r["times"][key] for r in results.values()]
    lengths = {len(t) for t in per_rank}
    if len(lengths) != 1:
        raise ConfigError(f"ranks reported different iteration counts {sorted(lengths)} for {key}")
    slowest = [max(ts) for ts in zip(*per_rank, strict=True)]
    return statistics.median(slowest), min(slowest)


def host_cpu_of(results: dict[int, dict[str, Any]], key: str) -> dict[str, float]:
    """``host_busy`` (share of all cores busy) and ``host_cpu_s`` (CPU-seconds per iteration) for ``key``.

    Taken from the lowest rank that sampled ``/proc/stat`` over the timed
    iterations (on an emulated cluster every host sees the whole machine);
    empty when none did.
    """
    for rank in sorted(results):
        use = (results[rank].get("host_cpu") or {}).get(key)
        if use:
            return {"host_busy": use["busy"], "host_cpu_s": use["cpu_s"], "host_cores": use.get("cores")}
    return {}


def fmt_busy(row: dict[str, Any]) -> str:
    """``97%`` of the host's cores busy during the timed iterations, ``—`` when not sampled."""
    busy = row.get("host_busy")
    return "—" if busy is None else f"{100 * busy:.0f}%"


def run(config: AllreduceConfig, options: RunOptions, model: CostModel,
        placement: Placement | None = None) -> list[dict[str, Any]]:
    """Run every (backend, N) job and return one row per (backend, N, size).

    ``placement``: where the jobs run when the caller already chose (an
    emulated cluster it started); None opens :meth:`RunOptions.placement`.
    """
    rows: list[dict[str, Any]] = []
    jobs = [(b, n) for n in config.num_procs for b in config.backends]
    args = ["--sizes", ",".join(map(str, config.sizes)), "--iters", str(config.iters),
            "--warmup", str(config.warmup)]
    with Progress(len(jobs) * len(config.sizes), "allreduce", options.progress) as bar, \
            options.placement(placement) as where:
        for backend, n in jobs:
            bar.update(0, f"{backend} np={n}")
            spec = options.job("allreduce", args, num_proc=n, controller=backend, placement=where)
            out = run_job(spec, on_event=lambda e: bar.update(1) if e.get("event") == "progress" else None)
            rows += rows_from(out, config, backend, n, model)
    return rows


def rows_from(out: JobOutput, config: AllreduceConfig, backend: str, n: int, model: CostModel
              ) -> list[dict[str, Any]]:
    """Rows of one finished job, with the model's prediction beside each.

    Raises:
        ConfigError: some rank sent no result.
    """
    results = out.results()
    if len(results) != n:
        raise ConfigError(f"{backend} np={n}: {len(results)} of {n} ranks reported a result")
    rows = []
    for nbytes in config.sizes:
        t, t_min = slowest_rank_median(results, str(nbytes))
        algbw = nbytes / t
        est = model.ring_allreduce(nbytes, n)
        predicted = est.total
        rows.append({"backend": backend, "np": n, "bytes": nbytes, "time_s": t, "min_s": t_min,
                     "algbw": algbw, "busbw": bus_bandwidth(algbw, n), "predicted_s": predicted,
                     "ratio": ratio(t, predicted), "bound": est.bound, **host_cpu_of(results, str(nbytes))})
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown table of the rows: time, algbw, busbw, model time, measured/model, host CPU busy."""
    headers = ["backend", "ranks", "size", "time", "algbw GB/s", "busbw GB/s", "model", "bound", "measured/model",
               "host CPU busy"]
    body = [[r["backend"], str(r["np"]), fmt_bytes(r["bytes"]), fmt_seconds(r["time_s"]), f"{r['algbw'] / 1e9:.3g}",
             f"{r['busbw'] / 1e9:.3g}", fmt_seconds(r["predicted_s"]), r.get("bound", "—"), fmt_ratio(r["ratio"]),
             fmt_busy(r)]
            for r in rows]
    return markdown_table(*with_runs(headers, body, rows))
