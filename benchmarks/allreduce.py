"""hora's allreduce against the raw engines it runs on, measured in the same job.

Three parts, each one function, picked with ``--part``:

* ``sizes``: one float32 allreduce (sum) of 4 KiB ... 256 MiB. hora
  (``hvd.allreduce``) against raw gloo (``torch.distributed.all_reduce``) and
  raw MPI (mpi4py ``Allreduce`` in place).  Median time, algbw, busbw and
  hora / best raw.
* ``gradset``: the 161 gradient tensors of ResNet-50 (97.5 MiB).  hora
  (``grouped_allreduce``, and 161 ``allreduce_async_`` + ``synchronize``)
  against per-tensor loops and one flat buffer on raw gloo and raw MPI, and
  DDP's exposed communication (forward+backward with DDP minus without).
* ``mlp``: training throughput of a 784-1024-1024-10 MLP, batch 128 per rank.
  hora's DistributedOptimizer against DDP (gloo) and one process with 1 and 2
  threads; scaling efficiency and peak RSS per rank.

Launch on 2 ranks (every process uses 1 torch thread)::

    mpirun -np 2 python benchmarks/allreduce.py --part all --json results.json
    hora run -np 2 --mpi python benchmarks/allreduce.py --part sizes

Within each part the peers are measured first, while no hora engine thread
is running; then hora once per ``--hora-controllers`` entry (default
``mpi,gloo``): initialised with ``HORA_CONTROLLER`` set, measured, shut down.
The MLP part runs first so that its peak-RSS figures do not include the
large buffers of the other parts.  Tables (markdown) are printed by rank 0
at the end.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import (
    CpuAccount,
    GiB,
    KiB,
    MiB,
    World,
    current_rss_mib,
    fmt_bytes,
    fmt_num,
    fmt_rate,
    fmt_seconds,
    foreign_cpu_load,
    free_port_everywhere,
    init_gloo,
    load_example_models,
    machine_info,
    markdown_table,
    median,
    peak_rss_mib,
    release_free_memory,
    reset_peak_rss,
    run_child,
    same_allocator_for_every_peer,
    start_world,
    time_interleaved,
    time_repeats,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel

PARTS = ("sizes", "gradset", "mlp")  # order of the tables
RUN_ORDER = ("mlp", "sizes", "gradset")  # mlp first: its peak-RSS figures should not carry the big buffers
DEFAULT_SIZES = "4K,64K,1M,16M,64M,256M"
RESNET50_TENSORS = 161
RESNET50_PARAMS = 25_557_032
MLP_SIZES = (784, 1024, 1024, 10)

Row = dict[str, Any]


def parse_size(text: str) -> int:
    """``64K`` / ``16M`` / ``1G`` / ``4096`` to bytes; must be a positive multiple of 4 (float32)."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": KiB, "M": MiB, "G": GiB}.get(text[-1:], 1)
    n = int(text[:-1] if scale > 1 else text) * scale
    if n <= 0 or n % 4:
        raise argparse.ArgumentTypeError(f"size {text!r} = {n} bytes is not a positive multiple of 4 (float32)")
    return n


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command line; defaults keep a full 2-rank run on a 2-core host under ~10 minutes."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--part", nargs="+", choices=(*PARTS, "all"), default=["all"], help="what to measure")
    p.add_argument("--hora-controllers", default="mpi,gloo",
                   help="comma-separated hora controllers to measure, each in its own init/shutdown; '' for none")
    p.add_argument("--json", type=Path, default=None, help="also write all results to this JSON file (rank 0)")
    g = p.add_argument_group("sizes")
    g.add_argument("--sizes", default=DEFAULT_SIZES, help="message sizes in bytes (K, M, G suffixes)")
    g.add_argument("--bytes-per-size", type=parse_size, default=GiB,
                   help="repeats per size = this / size, clamped to [--min-repeats, --max-repeats]")
    g.add_argument("--min-repeats", type=int, default=3)
    g.add_argument("--max-repeats", type=int, default=200)
    g.add_argument("--batch-below", type=parse_size, default=256 * KiB,
                   help="messages smaller than this run size-dependent back-to-back ops per timed repeat")
    g.add_argument("--max-batch", type=int, default=32, help="most back-to-back ops per timed repeat")
    g.add_argument("--pair-from", type=parse_size, default=MiB,
                   help="from this size, hora's repeats alternate with both raw engines' (paired ratio)")
    g = p.add_argument_group("gradset")
    g.add_argument("--gradset-repeats", type=int, default=10)
    g.add_argument("--gradset-warmup", type=int, default=2)
    g.add_argument("--ddp-batch-size", type=int, default=2, help="ResNet-50 batch for the DDP backward timing")
    g.add_argument("--ddp-image-size", type=int, default=64, help="image side for the DDP backward timing")
    g = p.add_argument_group("mlp")
    g.add_argument("--mlp-batch-size", type=int, default=128, help="batch per rank")
    g.add_argument("--mlp-steps", type=int, default=30, help="training steps per timed repeat")
    g.add_argument("--mlp-repeats", type=int, default=3)
    g.add_argument("--mlp-warmup", type=int, default=5, help="untimed steps first")
    g.add_argument("--mlp-paired-repeats", type=int, default=12,
                   help="paired blocks of each case (solo, no communication, raw MPI, DDP, hora) per hora "
                        "controller, in cycles of 4 (each case once after each other); 0 skips them")
    p.add_argument("--malloc-tuning", action=argparse.BooleanOptionalAction, default=True,
                   help="run every peer with the glibc malloc thresholds hora sets at init (off: glibc's "
                        "dynamic defaults for all, hora included)")
    p.add_argument("--child-mlp-threads", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.parts = PARTS if "all" in args.part else tuple(x for x in PARTS if x in args.part)
    args.size_list = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    args.controllers = [c.strip() for c in args.hora_controllers.split(",") if c.strip()]
    for c in args.controllers:
        if c not in ("mpi", "gloo"):
            p.error(f"--hora-controllers: {c!r} is not 'mpi' or 'gloo'")
    if not 1 <= args.min_repeats <= args.max_repeats:
        p.error(f"need 1 <= --min-repeats ({args.min_repeats}) <= --max-repeats ({args.max_repeats})")
    return args


def log(world: World | None, msg: str) -> None:
    """Progress line on stderr from rank 0."""
    if world is None or world.rank == 0:
        print(msg, file=sys.stderr, flush=True)


def check_sum(world: World, name: str, buf: torch.Tensor, run: Callable[[], torch.Tensor]) -> None:
    """Fill ``buf`` with ``rank + 1``, allreduce once, require ``1 + ... + size`` everywhere.

    Raises:
        RuntimeError: a wrong result, naming the engine and the first value seen.
    """
    buf.fill_(world.rank + 1)
    out = run()
    expected = world.size * (world.size + 1) / 2
    if not bool(torch.all(out == expected)):
        raise RuntimeError(f"{name}: allreduce of {buf.numel()} floats gave {out.view(-1)[:3].tolist()}..., "
                           f"expected {expected}")


# --------------------------------------------------------------------------- engines


def raw_mpi_allreduce(world: World, buf: torch.Tensor) -> Callable[[], torch.Tensor]:
    """In-place ``MPI_Allreduce`` (sum) of ``buf`` through a numpy view that shares its memory."""
    arr, in_place, op = buf.numpy(), world.mpi.IN_PLACE, world.mpi.SUM

    def run() -> torch.Tensor:
        world.comm.Allreduce(in_place, arr, op=op)
        return buf

    return run


def raw_gloo_allreduce(buf: torch.Tensor) -> Callable[[], torch.Tensor]:
    """In-place gloo ``all_reduce`` (sum) on torch.distributed's default group."""

    def run() -> torch.Tensor:
        dist.all_reduce(buf)
        return buf

    return run


def hora_allreduce(hvd: ModuleType, buf: torch.Tensor, name: str) -> Callable[[], torch.Tensor]:
    """hora's synchronous in-place ``hvd.allreduce_(buf, op=hvd.Sum)``.

    In place, like the raw peers: the out-of-place ``hvd.allreduce`` also
    allocates its result, and for large tensors the page faults of a fresh
    allocation cost more than the collective (see docs/benchmarks.md).
    """

    def run() -> torch.Tensor:
        return hvd.allreduce_(buf, op=hvd.Sum, name=name)

    return run


# --------------------------------------------------------------------------- part a: sizes


def repeats_for(nbytes: int, args: argparse.Namespace) -> tuple[int, int, int]:
    """(warmup, repeats, ops per repeat) for a message size.

    About ``--bytes-per-size`` are moved per size and engine.  Messages below
    ``--batch-below`` run several back-to-back allreduces per timed repeat, so
    that the barrier starting each repeat does not dominate a few-µs operation.
    """
    ops = max(1, min(args.max_batch, args.batch_below // nbytes))
    repeats = max(args.min_repeats, min(args.max_repeats, args.bytes_per_size // (nbytes * ops)))
    return max(1, min(10, repeats // 10)), repeats, ops


def repeated(fn: Callable[[], Any], times: int) -> Callable[[], None]:
    """``fn`` called ``times`` times in a row, as one callable."""
    if times == 1:
        return fn

    def run() -> None:
        for _ in range(times):
            fn()

    return run


def bench_sizes(world: World, args: argparse.Namespace, engine: str, hvd: ModuleType | None = None) -> list[Row]:
    """Part a for one engine (``mpi``, ``gloo`` or ``hora-<controller>``): one row per message size."""
    rows = []
    for nbytes in args.size_list:
        buf = torch.zeros(nbytes // 4, dtype=torch.float32)
        if engine == "mpi":
            run = raw_mpi_allreduce(world, buf)
        elif engine == "gloo":
            run = raw_gloo_allreduce(buf)
        else:
            run = hora_allreduce(hvd, buf, f"bench.sizes.{nbytes}")
        check_sum(world, engine, buf, run)
        buf.zero_()  # zeros stay zeros: no overflow, no denormals, however many repeats
        warmup, repeats, ops = repeats_for(nbytes, args)
        paired = None
        if engine.startswith("hora") and nbytes >= args.pair_from:
            # Both raw engines run again here, one repeat of each in turn with hora's, so that
            # hora's ratio to the best of them does not depend on load drift between phases.
            raw_bufs = [torch.zeros_like(buf), torch.zeros_like(buf)]
            cases = {"hora": run, "mpi": raw_mpi_allreduce(world, raw_bufs[0]),
                     "gloo": raw_gloo_allreduce(raw_bufs[1])}
            times = time_interleaved(world, {k: repeated(f, ops) for k, f in cases.items()}, warmup, repeats)
            samples = times["hora"]
            paired = [h / min(m, g) for h, m, g in zip(samples, times["mpi"], times["gloo"], strict=True)]
            del raw_bufs, cases
        else:
            samples = time_repeats(world, repeated(run, ops), warmup, repeats)
        t = median(samples) / ops
        algbw = nbytes / t
        rows.append({"engine": engine, "bytes": nbytes, "time_s": t, "repeats": repeats, "ops_per_repeat": ops,
                     "algbw_GBps": algbw / 1e9, "busbw_GBps": algbw * 2 * (world.size - 1) / world.size / 1e9})
        if paired is not None:
            rows[-1]["paired_ratio"] = median(paired)
        log(world, f"[sizes] {engine:>9} {fmt_bytes(nbytes):>8}: {fmt_seconds(t):>10}  "
                   f"busbw {rows[-1]['busbw_GBps']:.2f} GB/s  ({repeats} repeats × {ops})")
        del buf, run
        gc.collect()
    return rows


def sizes_table(rows: list[Row]) -> str:
    """Markdown: one line per size and engine; hora lines carry hora / best raw, unpaired and paired."""
    best_raw = {}
    for r in rows:
        if r["engine"] in ("mpi", "gloo"):
            best_raw[r["bytes"]] = min(best_raw.get(r["bytes"], float("inf")), r["time_s"])
    order = {"mpi": 0, "gloo": 1, "hora-mpi": 2, "hora-gloo": 3}
    out = []
    for r in sorted(rows, key=lambda r: (r["bytes"], order.get(r["engine"], 2), r["engine"])):
        ratio = r["time_s"] / best_raw[r["bytes"]] if r["engine"].startswith("hora") and r["bytes"] in best_raw \
            else None
        out.append([fmt_bytes(r["bytes"]), label(r["engine"]), fmt_seconds(r["time_s"]), fmt_rate(r["algbw_GBps"]),
                    fmt_rate(r["busbw_GBps"]), fmt_num(ratio), fmt_num(r.get("paired_ratio")),
                    f"{r['repeats']} × {r['ops_per_repeat']}"])
    return markdown_table(["size", "engine", "median time", "algbw GB/s", "busbw GB/s", "time ÷ best raw",
                           "÷ best raw, paired",
                           "repeats × ops"], out)


def label(engine: str) -> str:
    """Human name of an engine key."""
    return {"mpi": "raw MPI (mpi4py)", "gloo": "raw gloo (torch.distributed)",
            "hora-mpi": "hora (mpi)", "hora-gloo": "hora (gloo)", "ddp": "torch DDP (gloo)"}.get(engine, engine)


# --------------------------------------------------------------------------- part b: gradset


def resnet50_gradients() -> list[torch.Tensor]:
    """Zero tensors shaped like ResNet-50's 161 parameters.

    Raises:
        RuntimeError: the model in examples/torch/models.py no longer has 161 tensors / 25.6 M parameters.
    """
    model = load_example_models().resnet50()
    grads = [torch.zeros_like(p) for p in model.parameters()]
    n = sum(g.numel() for g in grads)
    if len(grads) != RESNET50_TENSORS or n != RESNET50_PARAMS:
        raise RuntimeError(f"ResNet-50 should have {RESNET50_TENSORS} tensors / {RESNET50_PARAMS} parameters, "
                           f"got {len(grads)} / {n}")
    return grads


def pack(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy tensors one after another into ``flat``."""
    offset = 0
    for t in tensors:
        flat[offset : offset + t.numel()].copy_(t.view(-1))
        offset += t.numel()


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` back into the tensors."""
    offset = 0
    for t in tensors:
        t.view(-1).copy_(flat[offset : offset + t.numel()])
        offset += t.numel()


def gradset_raw_cases(world: World, grads: list[torch.Tensor], flat: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """The raw-engine ways to reduce the gradient set, keyed by (engine, method)."""
    mpi_each = [raw_mpi_allreduce(world, g) for g in grads]
    mpi_flat = raw_mpi_allreduce(world, flat)

    def gloo_async() -> None:
        for work in [dist.all_reduce(g, async_op=True) for g in grads]:
            work.wait()

    def with_copies(run: Callable[[], Any]) -> Callable[[], None]:
        def packed() -> None:
            pack(grads, flat)
            run()
            unpack(flat, grads)
        return packed

    return {
        "mpi|per-tensor loop": lambda: [run() for run in mpi_each],
        "mpi|flat buffer": mpi_flat,
        "mpi|flat + pack/unpack": with_copies(mpi_flat),
        "gloo|per-tensor loop": lambda: [dist.all_reduce(g) for g in grads],
        "gloo|per-tensor async": gloo_async,
        "gloo|flat buffer": lambda: dist.all_reduce(flat),
        "gloo|flat + pack/unpack": with_copies(lambda: dist.all_reduce(flat)),
    }


def gradset_hora_cases(hvd: ModuleType, grads: list[torch.Tensor]) -> dict[str, Callable[[], Any]]:
    """hora's ways to reduce the gradient set: one grouped call, and 161 async in-place calls."""

    def async_all() -> None:
        handles = [hvd.allreduce_async_(g, op=hvd.Sum, name=f"bench.grad.{i}") for i, g in enumerate(grads)]
        for h in handles:
            hvd.synchronize(h)

    cases = {"async ×161 + synchronize": async_all}
    if hasattr(hvd, "grouped_allreduce"):
        cases["grouped_allreduce"] = lambda: hvd.grouped_allreduce(grads, op=hvd.Sum, name="bench.grads")
    return cases


def bench_gradset(world: World, args: argparse.Namespace, engine: str, hvd: ModuleType | None = None) -> list[Row]:
    """Part b for the raw engines (``engine='raw'``) or one hora controller (``hora-<controller>``)."""
    grads = resnet50_gradients()
    total = sum(g.numel() for g in grads) * 4
    rows = []
    flat = torch.zeros(total // 4)
    if engine == "raw":
        cases = gradset_raw_cases(world, grads, flat)
        times = {key: time_repeats(world, run, args.gradset_warmup, args.gradset_repeats)
                 for key, run in cases.items()}
        paired = None
    else:
        # The raw flat allreduce on hora's engine runs again here, one repeat in turn with
        # hora's, so that hora's ratio to it is not at the mercy of load drift between phases.
        raw_flat = raw_mpi_allreduce(world, flat) if engine == "hora-mpi" else lambda: dist.all_reduce(flat)
        cases = {"paired|flat": raw_flat, **{f"{engine}|{k}": v for k, v in gradset_hora_cases(hvd, grads).items()}}
        times = time_interleaved(world, cases, args.gradset_warmup, args.gradset_repeats)
        paired = times.pop("paired|flat")
    for key, samples in times.items():
        eng, method = key.split("|")
        t = median(samples)
        row = {"engine": eng, "method": method, "time_s": t, "bytes": total, "tensors": len(grads),
               "busbw_GBps": total / t * 2 * (world.size - 1) / world.size / 1e9}
        if paired is not None:
            row["paired_flat_s"] = median(paired)
            row["paired_ratio"] = median([a / b for a, b in zip(samples, paired, strict=True)])
        rows.append(row)
        log(world, f"[gradset] {eng:>9} {method:<26}: {fmt_seconds(t)}")
    if engine == "raw":
        rows.append(ddp_exposed_comm(world, args))
    return rows


def ddp_exposed_comm(world: World, args: argparse.Namespace) -> Row:
    """DDP's communication cost on ResNet-50: forward+backward with DDP minus the same without.

    ``broadcast_buffers=False`` keeps DDP's per-forward BatchNorm buffer
    broadcast out, so the difference is the gradient allreduce (25 MiB
    buckets, overlapped with backward) plus its hooks: the part that the
    backward does not hide.
    """
    models = load_example_models()
    torch.manual_seed(0)
    x = torch.randn(args.ddp_batch_size, 3, args.ddp_image_size, args.ddp_image_size)
    y = torch.randint(0, 1000, (args.ddp_batch_size,))
    plain = models.resnet50()
    with warnings.catch_warnings():
        # torch suggests forward_sync_buffers instead, which still syncs at init; False here is what we want.
        warnings.simplefilter("ignore", FutureWarning)
        ddp = DistributedDataParallel(models.resnet50(), broadcast_buffers=False)

    def step(model: nn.Module) -> None:
        model.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()

    # Alternate the two so that drifts in machine load hit both alike; the
    # estimate is the median of the paired differences.
    plain_t, ddp_t = [], []
    for i in range(args.gradset_warmup + args.gradset_repeats):
        a = time_repeats(world, lambda: step(plain), 0, 1)[0]
        b = time_repeats(world, lambda: step(ddp), 0, 1)[0]
        if i >= args.gradset_warmup:
            plain_t.append(a)
            ddp_t.append(b)
    t_plain, t_ddp = median(plain_t), median(ddp_t)
    diff = median([b - a for a, b in zip(plain_t, ddp_t, strict=True)])
    log(world, f"[gradset] DDP fwd+bwd {fmt_seconds(t_ddp)} vs plain {fmt_seconds(t_plain)}")
    total = RESNET50_PARAMS * 4
    return {"engine": "ddp", "method": "fwd+bwd with DDP − without", "time_s": diff, "bytes": total,
            "tensors": RESNET50_TENSORS, "busbw_GBps": float("nan"), "ddp_step_s": t_ddp, "plain_step_s": t_plain,
            "input": f"{args.ddp_batch_size}x3x{args.ddp_image_size}x{args.ddp_image_size}"}


def gradset_table(rows: list[Row]) -> str:
    """Markdown: one line per engine and method; hora lines carry hora / raw flat on the same engine."""
    flat = {r["engine"]: r["time_s"] for r in rows if r["method"] == "flat buffer"}
    out = []
    for r in rows:
        base = flat.get(r["engine"].removeprefix("hora-")) if r["engine"].startswith("hora-") else None
        note = ""
        if r["engine"] == "ddp":
            note = f"{fmt_seconds(r['ddp_step_s'])} − {fmt_seconds(r['plain_step_s'])}, input {r['input']}"
        if "paired_ratio" in r:
            note = f"raw flat timed in turn with it: {fmt_seconds(r['paired_flat_s'])}"
        out.append([label(r["engine"]), r["method"],
                    fmt_seconds(r["time_s"]), fmt_rate(r["busbw_GBps"]),
                    fmt_num(r["time_s"] / base if base else None), fmt_num(r.get("paired_ratio")), note])
    return markdown_table(["engine", "method", "median time", "busbw GB/s", "÷ raw flat, same engine",
                           "÷ raw flat, paired", "note"], out)


# --------------------------------------------------------------------------- part c: MLP


def mlp_setup(batch: int, seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The 784-1024-1024-10 MLP with one fixed synthetic batch."""
    torch.manual_seed(seed)
    model = load_example_models().MLP(MLP_SIZES)
    return model, torch.randn(batch, MLP_SIZES[0]), torch.randint(0, MLP_SIZES[-1], (batch,))


def sgd_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
             after_backward: Callable[[], None] | None = None) -> None:
    """One plain training step (``after_backward`` runs between backward and the update)."""
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    if after_backward is not None:
        after_backward()
    optimizer.step()


def mlp_throughput(world: World | None, args: argparse.Namespace, step: Callable[[], None]) -> float:
    """Samples per second of the whole job: median over repeats of ``--mlp-steps`` steps."""
    size = 1 if world is None else world.size

    def steps() -> None:
        for _ in range(args.mlp_steps):
            step()

    for _ in range(args.mlp_warmup):
        step()
    t = median(time_repeats(world, steps, 0, args.mlp_repeats))
    return args.mlp_batch_size * size * args.mlp_steps / t


def child_mlp(args: argparse.Namespace) -> int:
    """Hidden ``--child-mlp-threads K`` mode: the 1-process baseline, printed as one JSON line."""
    torch.set_num_threads(args.child_mlp_threads)
    try:  # the launcher may have bound the parent rank to one core; the baseline may use all
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except OSError:
        pass
    reset_peak_rss()
    model, x, y = mlp_setup(args.mlp_batch_size)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rate = mlp_throughput(None, args, lambda: sgd_step(model, opt, x, y))
    print(json.dumps({"samples_per_s": rate, "peak_rss_mib": peak_rss_mib(), "threads": torch.get_num_threads(),
                      "cpus": sorted(os.sched_getaffinity(0))}))
    return 0


def mlp_single_process(world: World, args: argparse.Namespace) -> list[Row]:
    """Rank 0 runs the 1-process baselines (1 and 2 threads) as children; the other ranks sleep meanwhile."""
    rows: list[Row] | None = None
    if world.rank == 0:
        rows = []
        for threads in (1, 2):
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child-mlp-threads", str(threads),
                   "--mlp-batch-size", str(args.mlp_batch_size), "--mlp-steps", str(args.mlp_steps),
                   "--mlp-repeats", str(args.mlp_repeats), "--mlp-warmup", str(args.mlp_warmup)]
            res = json.loads(run_child(cmd, threads, timeout_s=600).strip().splitlines()[-1])
            rows.append({"engine": f"1 process × {threads} thread{'s' if threads > 1 else ''}", "ranks": 1,
                         "samples_per_s": res["samples_per_s"], "peak_rss_mib": [res["peak_rss_mib"]],
                         "threads": res["threads"], "cpus": res["cpus"]})
            log(world, f"[mlp] {rows[-1]['engine']}: {res['samples_per_s']:.0f} samples/s on CPUs {res['cpus']}")
    world.idle_barrier()
    return world.bcast(rows)


def mlp_distributed(world: World, args: argparse.Namespace, engine: str, hvd: ModuleType | None = None) -> Row:
    """2-rank MLP training with DDP (``engine='ddp'``) or hora's DistributedOptimizer (``hora-<controller>``)."""
    gc.collect()
    base_rss = current_rss_mib()
    peak_reset = reset_peak_rss()
    model, x, y = mlp_setup(args.mlp_batch_size)
    if engine == "ddp":
        model = DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), op=hvd.Average)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    rate = mlp_throughput(world, args, lambda: sgd_step(model, opt, x, y))
    peaks = world.comm.allgather(peak_rss_mib())
    bases = world.comm.allgather(base_rss)
    log(world, f"[mlp] {engine}: {rate:.0f} samples/s, peak RSS per rank {[round(p) for p in peaks]} MiB")
    return {"engine": engine, "ranks": world.size, "samples_per_s": rate, "peak_rss_mib": peaks,
            "rss_before_mib": bases, "peak_is_per_phase": peak_reset}


def mlp_paired(world: World, args: argparse.Namespace, engine: str, hvd: ModuleType) -> list[Row]:
    """Part c again, in paired blocks: one process alone, two without communication, raw MPI, DDP and hora.

    Each case trains its own copy of the MLP for ``--mlp-steps`` steps per
    block; the blocks run in a balanced order (every case once after each
    other per cycle, :func:`common.time_interleaved`), ``--mlp-paired-repeats``
    blocks of each, and every ratio is the median of per-cycle ratios, so
    that load drift hits all cases alike.  The solo block runs on rank 0 while the
    other ranks wait without spinning: it is the 1-process-1-thread baseline
    measured minutes, not a phase, apart from the others.  The no-communication
    block is the ceiling of any data-parallel method on this host.
    """
    n, batch, size = args.mlp_steps, args.mlp_batch_size, world.size
    mpi, comm = world.mpi, world.comm
    _, x, y = mlp_setup(batch)  # every case trains a fresh copy of the model on this batch

    def steps_of(model: nn.Module, opt: torch.optim.Optimizer | None = None,
                 after_backward: Callable[[], None] | None = None) -> Callable[[], None]:
        opt = opt or torch.optim.SGD(model.parameters(), lr=0.01)

        def run() -> None:
            for _ in range(n):
                sgd_step(model, opt, x, y, after_backward)
        return run

    solo_run = steps_of(mlp_setup(batch)[0])

    def solo() -> None:
        if world.rank == 0:
            solo_run()
        world.idle_barrier(0.0005)

    raw_model = mlp_setup(batch)[0]
    raw_params = list(raw_model.parameters())

    def raw_allreduce() -> None:  # what a user writes with mpi4py: sum each gradient, then divide
        for p in reversed(raw_params):
            comm.Allreduce(mpi.IN_PLACE, p.grad.numpy(), op=mpi.SUM)
            p.grad.div_(size)

    hora_model = mlp_setup(batch)[0]
    hora_opt = hvd.DistributedOptimizer(torch.optim.SGD(hora_model.parameters(), lr=0.01),
                                        named_parameters=hora_model.named_parameters(), op=hvd.Average)
    cases = {
        "1 process × 1 thread": solo,
        "2 processes, no communication": steps_of(mlp_setup(batch)[0]),
        "raw MPI (mpi4py) allreduce loop": steps_of(raw_model, after_backward=raw_allreduce),
        "ddp": steps_of(DistributedDataParallel(mlp_setup(batch)[0])),
        engine: steps_of(hora_model, hora_opt),
    }
    times = time_interleaved(world, cases, 1, args.mlp_paired_repeats)
    solo_t, ddp_t = times["1 process × 1 thread"], times["ddp"]
    rows = []
    for name, ts in times.items():
        ranks = 1 if name.startswith("1 process") else size
        rows.append({"engine": name, "ranks": ranks, "paired_block": engine,
                     "samples_per_s": batch * n * ranks / median(ts),
                     "efficiency_paired": None if ranks == 1 else median(
                         [s / t for s, t in zip(solo_t, ts, strict=True)]),
                     "vs_ddp_paired": None if ranks == 1 else median([d / t for d, t in zip(ddp_t, ts, strict=True)])})
        log(world, f"[mlp paired, {engine} phase] {name}: {rows[-1]['samples_per_s']:.0f} samples/s")
    return rows


def mlp_paired_table(rows: list[Row]) -> str:
    """Markdown: the paired blocks of each hora phase."""
    out = [[r["paired_block"], label(r["engine"]), str(r["ranks"]), f"{r['samples_per_s']:.0f}",
            fmt_num(r["efficiency_paired"]), fmt_num(r["vs_ddp_paired"])] for r in rows]
    return markdown_table(["phase", "case", "ranks", "samples/s (all ranks)", "scaling efficiency, paired",
                           "÷ DDP, paired"], out)


def mlp_table(rows: list[Row], world_size: int) -> str:
    """Markdown: throughput, scaling efficiency against 1 process × 1 thread, peak RSS."""
    rows = [r for r in rows if "paired_block" not in r]
    one = next((r["samples_per_s"] for r in rows if r["engine"].startswith("1 process × 1 ")), None)
    two_threads = next((r["samples_per_s"] for r in rows if r["engine"].startswith("1 process × 2 ")), None)
    out = []
    for r in rows:
        multi = r["ranks"] > 1
        eff = r["samples_per_s"] / (world_size * one) if (multi and one) else None
        vs2 = r["samples_per_s"] / two_threads if (multi and two_threads) else None
        name = label(r["engine"])
        rss = "/".join(f"{p:.0f}" for p in r["peak_rss_mib"])
        grown = "/".join(str(round(p - b)) for p, b in zip(r["peak_rss_mib"], r["rss_before_mib"], strict=True)) \
            if "rss_before_mib" in r else "—"
        out.append([name, str(r["ranks"]), f"{r['samples_per_s']:.0f}", fmt_num(eff), fmt_num(vs2), rss, grown])
    return markdown_table(["engine", "ranks", "samples/s (all ranks)", "scaling efficiency",
                           "÷ 1 proc × 2 threads", "peak RSS MiB (per rank)", "growth during run MiB"], out)


# --------------------------------------------------------------------------- hora


def open_hora(world: World, controller: str) -> tuple[ModuleType | None, str]:
    """``hvd.init()`` with ``HORA_CONTROLLER=controller`` on every rank; (hvd, '') or (None, why not).

    All ranks agree on the outcome, so a failure on one rank skips the
    controller everywhere instead of leaving the others in a collective.
    """
    hvd, why = None, ""
    if controller == "gloo" and "HORA_RENDEZVOUS_ADDR" not in os.environ and "MASTER_ADDR" not in os.environ:
        # Under plain mpirun nobody hosts a rendezvous for hora's gloo groups:
        # hand it an address the way `hora run` would.
        addr, port = free_port_everywhere(world)
        os.environ["HORA_RENDEZVOUS_ADDR"], os.environ["HORA_RENDEZVOUS_PORT"] = addr, str(port)
    try:
        import hora.torch as hvd

        os.environ["HORA_CONTROLLER"] = controller
        hvd.init()
    except Exception as e:  # report and move on: the raw columns are still worth having
        why = f"hora ({controller}) unavailable on rank {world.rank}: {type(e).__name__}: {e}"
    whys = [w for w in world.comm.allgather(why) if w]
    if whys:
        if hvd is not None and not why:
            try:
                hvd.shutdown()
            except Exception:
                pass
        return None, whys[0]
    return hvd, ""


# --------------------------------------------------------------------------- main


def measure_raw(world: World, args: argparse.Namespace, part: str) -> list[Row]:
    """The peers' rows of one part: raw MPI and gloo, DDP, the 1-process baselines."""
    if part == "sizes":
        return bench_sizes(world, args, "mpi") + bench_sizes(world, args, "gloo")
    if part == "gradset":
        return bench_gradset(world, args, "raw")
    return mlp_single_process(world, args) + [mlp_distributed(world, args, "ddp")]


def measure_hora(world: World, args: argparse.Namespace, part: str, engine: str, hvd: ModuleType) -> list[Row]:
    """hora's rows of one part, with the engine already initialised."""
    if part == "sizes":
        return bench_sizes(world, args, engine, hvd)
    if part == "gradset":
        return bench_gradset(world, args, engine, hvd)
    rows = [mlp_distributed(world, args, engine, hvd)]
    if args.mlp_paired_repeats:
        rows += mlp_paired(world, args, engine, hvd)
        release_free_memory()  # the next phase's peak RSS should not hold the five models of these blocks
    return rows


def run_part(world: World, args: argparse.Namespace, part: str, notes: dict[str, None]) -> list[Row]:
    """Measure one part: the peers first, then hora once per controller, each in its own init/shutdown.

    A hora failure inside a measurement is not caught: the rank exits, and
    the launcher stops the job instead of leaving the other rank in a
    collective that never completes.
    """
    rows = measure_raw(world, args, part)
    for controller in args.controllers:
        hvd, why = open_hora(world, controller)
        if hvd is None:
            if why not in notes:
                log(world, why)
            notes[why] = None
            continue
        rows += measure_hora(world, args, part, f"hora-{controller}", hvd)
        hvd.shutdown()
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Measure the selected parts and print one markdown table per part on rank 0."""
    args = parse_args(argv)
    allocator = same_allocator_for_every_peer(args.malloc_tuning)
    if args.child_mlp_threads:
        return child_mlp(args)
    os.environ["OMP_NUM_THREADS"] = "1"  # for anything started from here; children set their own
    torch.set_num_threads(1)

    world = start_world()
    init_gloo(world)
    info = machine_info(world)
    log(world, f"# {info.describe()}")
    info.extra["foreign_cpu_load_before"] = load = foreign_cpu_load(world)
    if load > 0.1:
        log(world, f"warning: {load:.0%} of this host's CPU is busy with other processes; numbers will be noisy")
    account = CpuAccount(world)
    account.start()
    notes: dict[str, None] = {allocator: None}  # ordered set
    results = {part: run_part(world, args, part, notes) for part in RUN_ORDER if part in args.parts}

    info.extra["foreign_cpu_load_during"] = during = account.foreign_share()
    info.extra["foreign_cpu_load_after"] = foreign_cpu_load(world)
    if world.rank == 0:
        print(f"Measured {info.describe()} Other processes used {info.extra['foreign_cpu_load_before']:.0%} "
              f"of the host's CPU just before the run, {during:.0%} during it "
              f"and {info.extra['foreign_cpu_load_after']:.0%} just after.\n")
        tables = {"sizes": ("Allreduce by message size (float32, sum)", sizes_table),
                  "gradset": ("ResNet-50 gradient set (161 tensors, 97.5 MiB)", gradset_table),
                  "mlp": ("MLP 784-1024-1024-10 training, batch 128 per rank", lambda r: mlp_table(r, world.size))}
        for part in args.parts:
            title, make = tables[part]
            print(f"## {title}\n\n{make(results[part])}\n")
            paired = [r for r in results[part] if "paired_block" in r]
            if paired:
                print(f"## {title}: paired blocks\n\n{mlp_paired_table(paired)}\n")
        for note in notes:
            print(f"Note: {note}")
        if args.json:
            payload = {"machine": asdict(info), "args": {k: v for k, v in vars(args).items() if k != "json"},
                       "results": results, "notes": notes}
            args.json.write_text(json.dumps(payload, indent=1, default=str))
            print(f"Wrote {args.json}")
    world.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
