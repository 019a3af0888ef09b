"""``hora bench kvstore``: push+pull of a payload through parameter servers, against allreduce.

W workers (or, with ``--workers 2,4,8``, each count in turn) push a float32
key and pull it back, through hora's ``dist_sync``
with S = 1, 2, 4, ... servers (``hora run -np W -s S``), and through
``dist_sync_allreduce`` (no servers) on the same load; each job runs
:mod:`hora.bench.workers.kvstore`.  The time of a size is the median over
iterations of the slowest worker.  Next to each row: the cost model's
push+pull (``2 max(S/B, W*S/(k*B)) + 4L``, with ``k`` the servers that hold
a slice of the key: all of them for a key above the big-array bound of
1,000,000 elements, one otherwise; on a host list the bytes per link are
counted for the placement ``hora run`` gives the servers) or ring time,
measured/model, and the row's time over allreduce's.

The parameter server comes with the KVStore issue; until ``hora.kvstore.dist``
imports and ``hora run`` accepts ``-s``, its rows are skipped with the reason.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Sequence
from typing import Any

from hora.bench.allreduce import fmt_busy, host_cpu_of, slowest_rank_median
from hora.bench.emulate import Placement
from hora.bench.jobs import JobSpec, run_job
from hora.bench.model import CostModel, Estimate
from hora.bench.options import RunOptions, ratio
from hora.bench.report import Progress, markdown_table, with_runs
from hora.bench.units import fmt_bytes, fmt_ratio, fmt_seconds
from hora.errors import ConfigError

#: Keys with more elements than this are split over all servers (MXNet's MXNET_KVSTORE_BIGARRAY_BOUND default).
BIGARRAY_BOUND = 1_000_000


@dataclasses.dataclass(kw_only=True, slots=True)
class KVStoreConfig:
    """What ``hora bench kvstore`` measures.

    Attributes:
        sizes: key sizes in bytes (float32).
        workers: worker processes W, or several counts (one set of jobs each).
        servers: server counts S, one ``dist_sync`` job each.
        allreduce: also run ``dist_sync_allreduce`` on the same load.
        backend: hora controller of the workers (and of the allreduce store).
        iters, warmup: timed and untimed push+pull iterations per size.
        optimizer: a server optimizer by name (``sgd``, ``adam``, ...; MXNet's
            defaults; ``sgd+momentum``: momentum 0.9); empty: the servers keep the sum.
    """

    sizes: Sequence[int]
    workers: int | Sequence[int] = 2
    servers: Sequence[int] = (1, 2)
    allreduce: bool = True
    backend: str = "gloo"
    iters: int = 10
    warmup: int = 2
    optimizer: str = ""

    def __post_init__(self) -> None:
        if not self.sizes or any(s <= 0 or s % 4 for s in self.sizes):
            raise ConfigError(f"--sizes {list(self.sizes)}: each must be a positive multiple of 4 bytes (float32)")
        if not self.worker_counts or min(self.worker_counts) < 1:
            raise ConfigError(f"--workers {self.workers}: every worker count must be >= 1")
        if any(s < 1 for s in self.servers):
            raise ConfigError(f"--servers {list(self.servers)}: each server count must be >= 1")
        if not self.servers and not self.allreduce:
            raise ConfigError("nothing to measure: give --servers, or drop --no-allreduce")
        if self.iters < 1 or self.warmup < 0:
            raise ConfigError(f"need --iters >= 1 and --warmup >= 0, got {self.iters} and {self.warmup}")

    @property
    def worker_counts(self) -> tuple[int, ...]:
        """The worker counts W to run, in order."""
        return (self.workers,) if isinstance(self.workers, int) else tuple(self.workers)

    def worker_args(self, kvstore: str) -> list[str]:
        """Arguments of :mod:`hora.bench.workers.kvstore`."""
        return ["--kvstore", kvstore, "--sizes", ",".join(map(str, self.sizes)), "--iters", str(self.iters),
                "--warmup", str(self.warmup), *(["--optimizer", self.optimizer] if self.optimizer else [])]


def why_unavailable(kvstore: str) -> str | None:
    """Why hora cannot run ``kvstore`` jobs in this installation yet, or None when it can."""
    module = "hora.kvstore.allreduce" if kvstore == "dist_sync_allreduce" else "hora.kvstore.dist"
    try:
        found = importlib.util.find_spec(module) is not None
    except ImportError:
        found = False
    if not found:
        return f"{module} is not importable yet (it comes with the KVStore issue)"
    if kvstore != "dist_sync_allreduce":
        from hora.runner.launch_config import LaunchConfig

        try:
            LaunchConfig(command=["true"], num_proc=1, num_servers=1)
        except ConfigError as e:
            return f"hora run does not start servers yet: {e}"
    return None


def servers_holding(nbytes: int, servers: int) -> int:
    """How many servers hold a slice of one key: all of them above the big-array bound, else one."""
    return servers if nbytes // 4 > BIGARRAY_BOUND else 1


def layout(spec: JobSpec) -> tuple[list[str], list[str]] | None:
    """The hosts of a job's workers and of its servers, as ``hora run`` places them; None on localhost.

    Asks the launcher's own planner (:func:`hora.runner.plan.plan_slots`)
    with the job's ``-H``/``--hostfile`` and ``--server-hosts``, so the model
    sees the placement the job really gets; None when there is no host list
    (everything on this host), no server, or the planner is not available.
    """
    if not (spec.hosts or spec.hostfile) or spec.num_servers < 1:
        return None
    try:
        from hora.runner.hostlist import parse_hostfile
        from hora.runner.launch_config import LaunchConfig
        from hora.runner.plan import plan_slots

        hosts = parse_hostfile(spec.hostfile) if spec.hostfile else spec.hosts
        slots = plan_slots(LaunchConfig(command=["true"], num_proc=spec.num_proc, hosts=hosts,
                                        num_servers=spec.num_servers, server_hosts=tuple(spec.server_hosts) or None))
    except (ImportError, ConfigError):
        return None
    return ([s.host for s in slots if s.role == "worker"], [s.host for s in slots if s.role == "server"])


def estimate(model: CostModel, kvstore: str, nbytes: int, workers: int, servers: int,
             placed: tuple[list[str], list[str]] | None = None) -> Estimate:
    """The model's push+pull (or ring allreduce for ``dist_sync_allreduce``), term by term.

    With ``placed`` (worker hosts, server hosts) the traffic is counted host
    by host; without, every server is taken to sit on a host of its own.
    """
    if kvstore == "dist_sync_allreduce":
        return model.ring_allreduce(nbytes, workers)
    k = servers_holding(nbytes, servers)
    if placed is not None:
        return model.ps_push_pull_placed(nbytes, placed[0], placed[1][:k])
    return model.ps_push_pull(nbytes, workers, k)


def predict(model: CostModel, kvstore: str, nbytes: int, workers: int, servers: int,
            placed: tuple[list[str], list[str]] | None = None) -> float:
    """The model's push+pull (or ring allreduce) time in seconds (see :func:`estimate`)."""
    return estimate(model, kvstore, nbytes, workers, servers, placed).total


def run(config: KVStoreConfig, options: RunOptions, model: CostModel, skipped: list[str] | None = None,
        placement: Placement | None = None) -> list[dict[str, Any]]:
    """Run, per worker count, the ``dist_sync`` jobs (one per server count) and the allreduce job.

    Returns one row per (W, store, S, size).

    Stores this installation cannot run yet are left out, with the reason
    appended to ``skipped`` (and printed above the progress bar).
    ``placement``: where the jobs run when the caller already chose (an
    emulated cluster it started); None opens :meth:`RunOptions.placement`.
    """
    stores = [("dist_sync", s) for s in config.servers] + ([("dist_sync_allreduce", 0)] if config.allreduce else [])
    plan = [(w, kv, s) for w in config.worker_counts for kv, s in stores]
    reasons = {kv: why_unavailable(kv) for kv, _ in stores}
    rows: list[dict[str, Any]] = []
    with Progress(len(plan) * len(config.sizes), "kvstore", options.progress) as bar, \
            options.placement(placement) as where:
        for workers, kvstore, servers in plan:
            if reasons[kvstore] is not None:
                message = f"skipping hora {kvstore}" + (f" -s {servers}" if servers else "") + f": {reasons[kvstore]}"
                bar.write(message)
                if skipped is not None:
                    skipped.append(message)
                bar.update(len(config.sizes))
                continue
            bar.update(0, f"{kvstore} -np {workers} -s {servers}")
            spec = options.job("kvstore", config.worker_args(kvstore), num_proc=workers,
                               controller=config.backend, num_servers=servers, placement=where)
            out = run_job(spec, on_event=lambda e: bar.update(1) if e.get("event") == "progress" else None)
            results = out.results()
            if len(results) != workers:
                raise ConfigError(f"{kvstore} -s {servers}: {len(results)} of {workers} workers reported")
            placed = layout(spec)
            memory = {"server_peak_rss_mib": [rss / 2**20 for rss, _ in out.server_memory],
                      "server_stored_mib": [stored / 2**20 for _, stored in out.server_memory]}
            for nbytes in config.sizes:
                t, t_min = slowest_rank_median(results, str(nbytes))
                est = estimate(model, kvstore, nbytes, workers, servers, placed)
                predicted = est.total
                rows.append({"system": f"hora {kvstore}", "kvstore": kvstore, "workers": workers,
                             "servers": servers, "bytes": nbytes, "time_s": t, "min_s": t_min,
                             "predicted_s": predicted, "ratio": ratio(t, predicted), "bound": est.bound,
                             "server_hosts": placed[1] if placed else None, **memory,
                             **host_cpu_of(results, str(nbytes))})
    add_comparisons(rows)
    return rows


def add_comparisons(rows: list[dict[str, Any]]) -> None:
    """Fill ``vs_allreduce`` (over hora allreduce's time, same size and W) and ``vs_one_server`` (same system)."""
    allreduce = {(r["bytes"], r["workers"]): r["time_s"] for r in rows if r["kvstore"] == "dist_sync_allreduce"
                 and r["system"].startswith("hora")}
    for r in rows:
        r["vs_allreduce"] = ratio(r["time_s"], allreduce.get((r["bytes"], r["workers"])))
        one = [o["time_s"] for o in rows if o["system"] == r["system"] and o["bytes"] == r["bytes"]
               and o["workers"] == r["workers"] and o["servers"] == 1]
        r["vs_one_server"] = ratio(r["time_s"], one[0]) if one and r["servers"] else None


def table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown table: time per push+pull, the model's, measured/model, vs allreduce, vs one server."""
    headers = ["system", "workers", "servers", "size", "push+pull", "model", "bound", "measured/model",
               "vs allreduce", "vs 1 server", "host CPU busy"]
    body = [[r["system"], str(r["workers"]), str(r["servers"]) if r["servers"] else "—", fmt_bytes(r["bytes"]),
             fmt_seconds(r["time_s"]), fmt_seconds(r.get("predicted_s")), r.get("bound", "—"),
             fmt_ratio(r.get("ratio")), fmt_ratio(r.get("vs_allreduce")), fmt_ratio(r.get("vs_one_server")),
             fmt_busy(r)]
            for r in sorted(rows, key=lambda r: (r["bytes"], r["workers"], r["system"], r["servers"]))]
    ordered = sorted(rows, key=lambda r: (r["bytes"], r["workers"], r["system"], r["servers"]))
    return markdown_table(*with_runs(headers, body, ordered))
