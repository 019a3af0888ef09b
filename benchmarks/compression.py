"""Gradient compression on slow links: hora's compressors against torch DDP's comm hooks, on an emulated cluster.

Starts an emulated cluster (``hora.testing.emulate``: 4 hosts x 1 rank,
links shaped to ``--link``, root and ``ip netns`` needed) and runs one job
on it in which every rank measures, in this order:

* per gradient set (``resnet50``: 161 tensors, 97.5 MiB; ``vgg16``: 138 M
  parameters, most in its two big fully connected layers), a module whose
  parameters have the set's shapes and whose gradient is the parameter itself
  (full rank).  The *exchange time* is the time of backward plus the
  reduction minus the time of the same backward alone, measured in the same
  job:
  - hora ``DistributedOptimizer`` (gloo) with none, fp16, bf16, PowerSGD ranks 1, 2, 4;
  - DDP over gloo (one bucket: ``bucket_cap_mb`` above the set, or gloo aborts
    with a collective-order mismatch under ``powerSGD_hook``) plain, with
    ``fp16_compress_hook`` and with ``powerSGD_hook`` at the same ranks;
* MLP 784-1024-1024-10 training throughput (samples/s), hora and DDP, with and
  without PowerSGD rank 2.

Run (as root)::

    python benchmarks/compression.py --hosts 4 --link 1gbit --sets resnet50,vgg16

It prints markdown tables, with ratios against hora's uncompressed exchange
and against DDP at the same setting, and each rank's peak memory.

Memory: VGG16's gradients are 528 MiB a rank.  One module per set serves
every case in turn (hora's cases, then DDP wrapping the same module with
``gradient_as_bucket_view``, so its one bucket *is* the gradients), and each
case's buffers are freed before the next: at most one case's state is alive.

``--hora-cases`` / ``--ddp-cases`` pick cases (comma-separated; default: all).
``fp16-horovod`` is the float16 cast as a compressor written Horovod's way
(a subclass whose ``compress`` returns a new tensor each step): the path that
``fp16`` took before its wire buffers were kept between steps.
``fp16-tensorwise`` / ``bf16-tensorwise`` are the casts without the flat cast
exchange (:mod:`hora.core.compression.cast`): each gradient cast into a wire
tensor of its own and submitted alone, the path before it.  ``--rounds N``
runs the hora cases N times in turn (medians in the table, each round below
it), so that cases compared with each other meet the same load.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HORA_CASES = ["none", "fp16", "bf16", "powersgd:1", "powersgd:2", "powersgd:4"]
DDP_CASES = ["none", "fp16", "powersgd:1", "powersgd:2", "powersgd:4"]


# --------------------------------------------------------------------------- worker (one rank)


def _interface_of(addr: str) -> str | None:
    """The network interface holding ``addr`` (so that DDP's gloo does not resolve the hostname to loopback)."""
    out = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        parts = line.split()
        if len(parts) > 3 and parts[3].split("/")[0] == addr:
            return parts[1]
    return None


def _my_addr(towards: str) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((towards, 9))
        return s.getsockname()[0]


def _timed(fn, warmup: int, iters: int) -> float:
    import hora.torch as hvd

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        hvd.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    # the slowest rank sets a step's time; every rank reports its own, the driver takes the max
    return statistics.median(times)


def _horovod_style_fp16() -> type:
    """``Compression.fp16`` as a user's Horovod-style subclass: a new wire tensor per step, decompress, copy."""
    from hora.core.compression import Compression, FP16Compressor

    class HorovodStyleFP16(Compression.fp16):
        @staticmethod
        def compress(tensor):
            return FP16Compressor.compress(tensor)

    return HorovodStyleFP16


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    import hora.torch as hvd
    from hora.bench.compression import gradient_set
    from hora.core.compression import parse_spec

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(1)
    rdv = os.environ.get("HORA_RENDEZVOUS_ADDR", "127.0.0.1")
    me = _my_addr(rdv) if rdv not in ("127.0.0.1", "localhost") else "127.0.0.1"
    iface = _interface_of(me)
    if iface:
        os.environ["GLOO_SOCKET_IFNAME"] = iface
    port = hvd.broadcast_object(_free_port() if rank == 0 else None, root_rank=0)
    dist.init_process_group("gloo", init_method=f"tcp://{rdv}:{port}", rank=rank, world_size=size)
    results: dict[str, dict[str, float]] = {}

    class HalfSquares(torch.autograd.Function):
        """sum(p*p)/2 over all parameters, whose gradient is each parameter itself (full rank).

        Backward hands the parameters over as their gradients, which autograd
        adds into the existing ``.grad`` in place: no temporaries, where
        ``(p*p).sum()`` made two of VGG16's 392 MiB layer at once.
        """

        @staticmethod
        def forward(ctx, *ps):
            ctx.save_for_backward(*ps)
            return ps[0].new_zeros(())

        @staticmethod
        def backward(ctx, grad):
            return ctx.saved_tensors

    class GradSet(torch.nn.Module):
        def __init__(self, shapes):
            super().__init__()
            g = torch.Generator().manual_seed(rank)
            self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s, generator=g) * 0.01) for s in shapes)
            for p in self.ps:
                p.grad = torch.zeros_like(p)  # defined from the start: backward adds into it, never aliases p

        def forward(self):
            return HalfSquares.apply(*self.ps)

    for name in args.sets.split(","):
        shapes = gradient_set(name)
        mib = sum(torch.Size(s).numel() for s in shapes) * 4 / 2**20
        model = GradSet(shapes)

        def local(model=model) -> None:
            model.zero_grad(set_to_none=False)
            model().backward()

        base = _timed(local, 1, 2 * args.iters)
        row = {"backward_s": base}
        # --rounds: the hora cases again and again, in turn, so that a before/after pair (fp16-tensorwise,
        # fp16) meets the same load; each round's figures are kept and the table shows their median.
        for spec in [s for _ in range(args.rounds) for s in args.hora_cases.split(",")]:
            compression = _horovod_style_fp16() if spec == "fp16-horovod" else parse_spec(
                spec.removesuffix("-tensorwise"))
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), compression=compression,
                                           named_parameters=[(f"{name}.{i}", p) for i, p in enumerate(model.ps)])
            if spec.endswith("-tensorwise"):
                opt._casts = None  # the binding's per-tensor path, as before the cast exchange

            def step(model=model, opt=opt) -> None:
                model.zero_grad(set_to_none=False)
                model().backward()
                opt.synchronize()

            row.setdefault(f"hora {spec}", []).append(_timed(step, args.warmup, args.iters) - base)
            opt.remove_hooks()
            del opt, step
            gc.collect()  # the compressor's buffers go before the next case's are made
        row["hora peak MiB"] = _peak_mib()
        # DDP wraps the same module: its one bucket becomes the gradients (gradient_as_bucket_view), so
        # no second copy of the parameters or gradients exists while it runs.
        for spec in args.ddp_cases.split(","):
            ddp = DistributedDataParallel(model, bucket_cap_mb=mib * 2 + 1, gradient_as_bucket_view=True)
            if spec == "fp16":
                ddp.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
            elif spec.startswith("powersgd"):
                state = powerSGD_hook.PowerSGDState(process_group=dist.group.WORLD,
                                                    matrix_approximation_rank=int(spec.split(":")[1]),
                                                    start_powerSGD_iter=2, min_compression_rate=2)
                ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)

            def ddp_step(ddp=ddp) -> None:
                ddp.zero_grad(set_to_none=False)
                ddp().backward()

            ddp_step()  # DDP's first iteration differs (bucket rebuild); PowerSGD starts after 2 plain steps
            ddp_step()
            row[f"ddp {spec}"] = _timed(ddp_step, args.warmup, args.iters) - base
            del ddp, ddp_step
            gc.collect()
        row["peak MiB"] = _peak_mib()
        del model, local
        gc.collect()
        results[name] = row
        if rank == 0:
            print(json.dumps({"progress": name}), flush=True)

    if args.mlp:
        x = torch.randn(args.mlp_batch, 784)
        y = torch.randint(0, 10, (args.mlp_batch,))

        def mlp():
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                       torch.nn.ReLU(), torch.nn.Linear(1024, 10))

        row = {}
        for spec in ("none", "powersgd:2"):
            model = mlp()
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                           named_parameters=model.named_parameters(), compression=parse_spec(spec))

            def train(model=model, opt=opt) -> None:
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()

            row[f"hora {spec}"] = args.mlp_batch * size / _timed(train, args.warmup, args.iters)
            opt.remove_hooks()
        for spec in ("none", "powersgd:2"):
            ddp = DistributedDataParallel(mlp(), bucket_cap_mb=64)
            if spec != "none":
                state = powerSGD_hook.PowerSGDState(process_group=dist.group.WORLD, matrix_approximation_rank=2,
                                                    start_powerSGD_iter=2, min_compression_rate=2)
                ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            sgd = torch.optim.SGD(ddp.parameters(), lr=0.01)

            def ddp_train(ddp=ddp, sgd=sgd) -> None:
                sgd.zero_grad()
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
                sgd.step()

            ddp_train()
            ddp_train()
            row[f"ddp {spec}"] = args.mlp_batch * size / _timed(ddp_train, args.warmup, args.iters)
        results["mlp_samples_per_s"] = row
    gathered = hvd.allgather_object(results)
    if rank == 0:
        print("RESULT " + json.dumps(gathered), flush=True)
    dist.destroy_process_group()
    hvd.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- driver


def driver(args: argparse.Namespace) -> None:
    from hora.bench.emulate import Emulation, emulated_hosts
    from hora.bench.jobs import job_env

    load = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with emulated_hosts(Emulation(hosts=args.hosts, link=args.link), calibrate_links=False) as where:
        hosts, _ = where.for_job(args.hosts)
        cmd = [*where.prefix, sys.executable, "-m", "hora.runner.cli", "run", "-np", str(args.hosts), "--gloo",
               "-H", hosts, *where.run_args, "--", sys.executable, str(Path(__file__).resolve()), "--worker",
               "--sets", args.sets, "--iters", str(args.iters), "--warmup", str(args.warmup),
               "--hora-cases", args.hora_cases, "--ddp-cases", args.ddp_cases, "--rounds", str(args.rounds),
               *(["--mlp"] if args.mlp else [])]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=job_env(), timeout=args.timeout)
    lines = [ln.split("RESULT ", 1)[1] for ln in proc.stdout.splitlines() if "RESULT " in ln]
    if proc.returncode or not lines:
        raise SystemExit(f"the job failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}")
    per_rank = json.loads(lines[-1])
    print(f"{started}, {args.hosts} emulated hosts x 1 rank, {args.link} links; load average before "
          f"{load[0]:.1f}, after {os.getloadavg()[0]:.1f} (2 cores shared with other jobs)\n")
    for name in args.sets.split(","):
        # a step ends when its slowest rank does
        # per round, the slowest rank's figure; then the median over rounds
        rounds = {k: [max(r[name][k][i] for r in per_rank) for i in range(args.rounds)]
                  for k in per_rank[0][name] if k.startswith("hora ") and k != "hora peak MiB"}
        row = {k: max(r[name][k] for r in per_rank) for k in per_rank[0][name] if k not in rounds}
        row.update({k: statistics.median(v) for k, v in rounds.items()})
        plain = row.get("hora none")
        print(f"### {name}: exchange time (backward + reduction - backward alone {row['backward_s'] * 1e3:.0f} ms)\n")
        print("| compressor | hora | hora / hora none | DDP | hora / DDP |\n|---|---|---|---|---|")
        for spec in args.hora_cases.split(","):
            h = row[f"hora {spec}"]
            d = row.get(f"ddp {spec.removesuffix('-horovod').removesuffix('-tensorwise')}")
            ddp = f"{d:.3f} s | {h / d:.2f}x" if d else "— | —"
            ratio = f"{h / plain:.2f}x" if plain else "—"
            print(f"| {spec} | {h:.3f} s | {ratio} | {ddp} |")
        if args.rounds > 1:
            print("\nEach round (s): " + "; ".join(f"{spec} " + ", ".join(f"{v:.3f}" for v in rounds[f"hora {spec}"])
                                                  for spec in args.hora_cases.split(",")))
        if "ddp none" in row:
            print("\nDDP's own ratios to its plain run: " + ", ".join(
                f"{spec} {row[f'ddp {spec}'] / row['ddp none']:.2f}x" for spec in args.ddp_cases.split(",")
                if spec != "none"))
        print(f"\nPeak memory per rank (max over ranks): after hora's cases {row['hora peak MiB']:.0f} MiB, "
              f"after DDP's {row['peak MiB']:.0f} MiB\n")
    if args.mlp:
        row = {k: min(r["mlp_samples_per_s"][k] for r in per_rank) for k in per_rank[0]["mlp_samples_per_s"]}
        print("### MLP 784-1024-1024-10 training, samples/s (all ranks)\n")
        print("| system | none | PowerSGD rank 2 | PowerSGD / none |\n|---|---|---|---|")
        for sysname in ("hora", "ddp"):
            a, b = row[f"{sysname} none"], row[f"{sysname} powersgd:2"]
            print(f"| {sysname} | {a:.0f} | {b:.0f} | {b / a:.2f}x |")
        ratio = row["hora powersgd:2"] / row["ddp powersgd:2"]
        print(f"\nhora PowerSGD rank 2 / DDP powerSGD_hook rank 2: {ratio:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--link", default="1gbit")
    p.add_argument("--sets", default="resnet50,vgg16")
    p.add_argument("--mlp", action="store_true", help="also MLP training throughput")
    p.add_argument("--mlp-batch", type=int, default=64)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout", type=float, default=3000)
    p.add_argument("--hora-cases", default=",".join(HORA_CASES), help="hora compressors to run (see the docstring)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the hora cases this many times in turn; the table shows each case's median")
    p.add_argument("--ddp-cases", default=",".join(DDP_CASES), help="DDP hooks to run: none, fp16, powersgd:R")
    args = p.parse_args()
    worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    main()
