"""``hora bench train``: synthetic training throughput at N = 1, 2, 4, ... ranks, and scaling efficiency.

One job per (strategy, N) runs :mod:`hora.bench.workers.train`.  Its step
time is the median over iterations of the slowest rank; then::

    img/s       = N * batch / step
    efficiency  = img/s(N) / (N * img/s(1))     (img/s(1): one rank of plain allreduce training)

The model's step is the compute time the job measured (local steps on all
ranks at once) plus the predicted exchange of the gradients (ring, or a PS
push+pull with the job's servers), with no overlap: ``--strategy ps`` needs
parameter servers, started with ``hora run -s S`` (``--servers``, default
one per worker, as in MXNet).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections.abc import Sequence
from typing import Any

from hora.bench.compression import compressed_ring, exchange
from hora.bench.emulate import Placement
from hora.bench.jobs import JobOutput, run_job
from hora.bench.kvstore import layout
from hora.bench.model import CostModel
from hora.bench.options import RunOptions, ratio
from hora.bench.report import Progress, markdown_table, with_runs
from hora.bench.units import fmt_bytes, fmt_ratio, fmt_seconds
from hora.core.compression import parse_spec
from hora.errors import ConfigError

STRATEGIES = ("allreduce", "ps")


@dataclasses.dataclass(kw_only=True, slots=True)
class TrainConfig:
    """What ``hora bench train`` measures.

    Attributes:
        num_procs: rank counts (N = 1, 2, 4, ...).
        strategies: ``allreduce`` and/or ``ps``.
        servers: parameter servers for ``ps``; None means one per worker.
        backend: hora controller for the allreduce strategy.
        model, batch_size, image_size: the synthetic workload.
        warmup, steps, iters: untimed steps, steps per timed iteration, iterations.
        compression: the allreduce strategy's compressor (``none``, ``fp16``, ``powersgd:2``...).
    """

    num_procs: Sequence[int] = (1, 2)
    strategies: Sequence[str] = ("allreduce",)
    servers: int | None = None
    backend: str = "gloo"
    model: str = "resnet18"
    batch_size: int = 32
    image_size: int = 32
    warmup: int = 2
    steps: int = 5
    iters: int = 3
    compression: str = "none"

    def __post_init__(self) -> None:
        try:
            parse_spec(self.compression)
        except ValueError as e:
            raise ConfigError(f"--compression: {e}") from None
        if self.compression != "none" and "ps" in self.strategies:
            raise ConfigError(f"--compression {self.compression} applies to --strategy allreduce, not ps")
        if not self.num_procs or any(n < 1 for n in self.num_procs):
            raise ConfigError(f"-np {list(self.num_procs)}: every rank count must be >= 1")
        bad = [s for s in self.strategies if s not in STRATEGIES]
        if bad or not self.strategies:
            raise ConfigError(f"--strategy {','.join(self.strategies)}: choose from {', '.join(STRATEGIES)}")
        if self.servers is not None and self.servers < 1:
            raise ConfigError(f"--servers {self.servers} must be >= 1")
        for name in ("batch_size", "image_size", "steps", "iters"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ConfigError(f"--warmup must be >= 0, got {self.warmup}")

    def worker_args(self, strategy: str) -> list[str]:
        """Arguments of :mod:`hora.bench.workers.train`."""
        return ["--model", self.model, "--batch-size", str(self.batch_size), "--image-size", str(self.image_size),
                "--warmup", str(self.warmup), "--steps", str(self.steps), "--iters", str(self.iters),
                "--strategy", strategy, "--compression", self.compression]


def run(config: TrainConfig, options: RunOptions, model: CostModel,
        placement: Placement | None = None) -> list[dict[str, Any]]:
    """Run every (strategy, N) job and return one row per job, with efficiencies filled in.

    ``placement``: where the jobs run when the caller already chose (an
    emulated cluster it started); None opens :meth:`RunOptions.placement`.
    """
    rows: list[dict[str, Any]] = []
    jobs = [(s, n) for s in config.strategies for n in sorted(config.num_procs)]
    with Progress(len(jobs) * (config.iters + 1), "train", options.progress) as bar, \
            options.placement(placement) as where:
        for strategy, n in jobs:
            bar.update(0, f"{strategy} np={n}")
            servers = (config.servers or n) if strategy == "ps" else 0
            args = config.worker_args(strategy)
            if options.emulation is not None or not (options.hosts or options.hostfile):
                # every rank runs on this machine (emulated hosts share its cores): split them, never oversubscribe
                args += ["--threads", str(max(1, (os.cpu_count() or 1) // n))]
            spec = options.job("train", args, num_proc=n, controller=config.backend, num_servers=servers,
                               placement=where)
            out = run_job(spec, on_event=lambda e: bar.update(1) if e.get("event") == "progress" else None)
            rows.append(row_from(out, strategy, n, servers, model, layout(spec)))
    add_efficiency(rows)
    return rows


def row_from(out: JobOutput, strategy: str, n: int, servers: int, model: CostModel,
             placed: tuple[list[str], list[str]] | None = None) -> dict[str, Any]:
    """One row of a finished job: step time, img/s, the model's step and img/s.

    The gradients of many parameters spread over all servers, so the PS
    exchange is modelled as one payload split over every server, placed as
    ``placed`` says (worker hosts, server hosts) when known.

    Raises:
        ConfigError: some rank sent no result.
    """
    results = out.results()
    if len(results) != n:
        raise ConfigError(f"{strategy} np={n}: {len(results)} of {n} ranks reported a result")
    first = next(iter(results.values()))
    per_rank = [r["step_times"] for r in results.values()]
    step = statistics.median(max(ts) for ts in zip(*per_rank, strict=True))
    compute = max(r["compute_s"] for r in results.values())
    nbytes, batch = int(first["param_bytes"]), int(first["batch_size"])
    spec = first.get("compression", "none")
    if strategy != "ps" and spec != "none":
        comm = compressed_ring(model, exchange([tuple(s) for s in first["param_shapes"]], spec), n).total
        strategy = f"{strategy}, {spec}"
    elif strategy != "ps":
        comm = model.ring_allreduce(nbytes, n).total
    elif placed is not None:
        comm = model.ps_push_pull_placed(nbytes, placed[0], placed[1]).total
    else:
        comm = model.ps_push_pull(nbytes, n, servers).total
    predicted_step = compute + comm
    sampled = next((r["host_cpu"] for _, r in sorted(results.items()) if r.get("host_cpu")), {})
    busy = {f"host_busy_{phase}": use["busy"] for phase, use in sampled.items() if use}
    return {**busy, "strategy": strategy, "np": n, "servers": servers, "model": first["model"], "batch_size": batch,
            "param_bytes": nbytes, "step_s": step, "compute_s": compute, "img_s": n * batch / step,
            "predicted_comm_s": comm, "predicted_step_s": predicted_step,
            "predicted_img_s": n * batch / predicted_step, "ratio": ratio(step, predicted_step),
            "exchange_efficiency": compute / step}


def add_efficiency(rows: list[dict[str, Any]]) -> None:
    """Measured and modelled scaling efficiency of each row.

    Measured: img/s over ``N`` times the one-rank img/s of plain allreduce
    training when that was run (one rank does no exchange, so it is the
    single-process speed), else over the smallest ``N`` of the row's own
    strategy, scaled.  Modelled: ``C / (C + T_comm)`` with the job's compute
    time ``C``, the cost model's definition.
    """
    singles = [r for r in rows if r["strategy"] == "allreduce" and r["np"] == 1]
    for r in rows:
        if singles:
            base = singles[0]
        else:
            base = min((o for o in rows if o["strategy"] == r["strategy"]), key=lambda o: o["np"])
        r["efficiency"] = r["img_s"] / (base["img_s"] * r["np"] / base["np"])
        r["predicted_efficiency"] = r["compute_s"] / r["predicted_step_s"]


def table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown table: img/s, efficiency, step, compute, compute/step, the model's step and efficiency, ratio.

    ``efficiency`` is against one rank; ``compute/step`` is the measured
    counterpart of the model's ``C / (C + T_comm)``: on a host whose ranks
    share its cores, ``C`` itself grows with ``N`` and only this pair compares
    the exchange alone.
    """
    headers = ["strategy", "ranks", "servers", "gradients", "img/s", "efficiency", "step", "compute",
               "compute/step", "model step", "model eff.", "measured/model", "CPU busy compute/train"]
    body = [[r["strategy"], str(r["np"]), str(r["servers"]) if r["servers"] else "—", fmt_bytes(r["param_bytes"]),
             f"{r['img_s']:.1f}", f"{100 * r['efficiency']:.0f}%", fmt_seconds(r["step_s"]),
             fmt_seconds(r["compute_s"]), f"{100 * r['compute_s'] / r['step_s']:.0f}%",
             fmt_seconds(r["predicted_step_s"]), f"{100 * r['predicted_efficiency']:.0f}%", fmt_ratio(r["ratio"]),
             _busy(r)] for r in rows]
    return markdown_table(*with_runs(headers, body, rows))


def _busy(row: dict[str, Any]) -> str:
    """``98%/95%``: the host's cores busy while the ranks computed alone, and while they trained."""
    shares = [row.get(f"host_busy_{phase}") for phase in ("compute", "train")]
    return "/".join("—" if v is None else f"{100 * v:.0f}%" for v in shares)
