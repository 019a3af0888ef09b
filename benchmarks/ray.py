"""hora.ray's two targets, measured in one run on a local Ray instance.

1. **Start**: the time from ``RayExecutor.start()`` to every worker ready
   (placement group, actors, ranks, rendezvous port, environment), beside the
   time Ray itself takes to do its part alone: reserve the same placement
   group, start as many bare actors in it and get one reply from each.  The
   two alternate, ``--start-repeats`` times each.
2. **Throughput**: the same MLP training function (784-1024-1024-10, SGD,
   batch ``--batch`` per rank, ``hvd.DistributedOptimizer``, 1 thread per
   rank) run through ``RayExecutor.run`` and through ``hora.run(...,
   use_gloo=True)``, which is ``hora run --gloo``'s path.  Each block times
   ``--steps`` steps after ``--warmup`` steps inside the function (slowest
   rank), so neither side pays its start-up there; each block gets new
   processes on both sides (``--reuse`` keeps one set of actors for every
   Ray block).  Blocks alternate in ABBA order; the ratio is the median of
   the per-pair ratios.

Run::

    python benchmarks/ray.py                      # 2 workers, 4 logical CPUs for Ray
    python benchmarks/ray.py --blocks 8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# This file's name would hide Ray's package from ``import ray``: drop its folder from the search path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
MLP_SIZES = (784, 1024, 1024, 10)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workers", type=int, default=2, help="ranks")
    p.add_argument("--num-cpus", type=int, default=4, help="logical CPUs of the local Ray instance")
    p.add_argument("--start-repeats", type=int, default=5, help="start() and bare-Ray starts, each")
    p.add_argument("--blocks", type=int, default=6, help="training blocks of each engine (ABBA order)")
    p.add_argument("--steps", type=int, default=40, help="timed steps per block")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per block")
    p.add_argument("--batch", type=int, default=128, help="batch per rank")
    p.add_argument("--reuse", action="store_true",
                   help="run every Ray block in the same actors (default: a new executor per block, as hora.run "
                        "starts new processes per block)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return p.parse_args(argv)


def mlp_block(steps: int, warmup: int, batch: int, models_path: str) -> dict[str, float]:
    """Train the MLP for ``warmup`` + ``steps`` steps on this rank; the timed part's seconds (slowest rank)."""
    import importlib.util

    import torch
    import torch.nn.functional as F

    import hora.torch as hvd

    if not hvd.is_initialized():
        hvd.init()
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("hora_example_models", models_path)
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    torch.manual_seed(0)
    model = models.MLP(MLP_SIZES)
    x, y = torch.randn(batch, MLP_SIZES[0]), torch.randint(0, MLP_SIZES[-1], (batch,))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    for _ in range(warmup):
        step()
    hvd.allreduce(torch.zeros(1), name="bench.barrier")
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    slowest = float(hvd.allreduce(torch.tensor([seconds]), op=hvd.Max, name="bench.seconds"))
    return {"seconds": slowest, "samples_per_s": batch * hvd.size() * steps / slowest, "cpu_s": cpu}


def bare_ray_start(ray, workers: int) -> float:
    """Ray alone: the same placement group, bare actors in it, one reply each; seconds."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote
    class Bare:
        def ping(self) -> int:
            return os.getpid()

    start = time.perf_counter()
    group = ray.util.placement_group([{"CPU": 1}] * workers, strategy="PACK")
    ray.get(group.ready())
    actors = [Bare.options(num_cpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=group, placement_group_bundle_index=i)).remote() for i in range(workers)]
    ray.get([a.ping.remote() for a in actors])
    seconds = time.perf_counter() - start
    for a in actors:
        ray.kill(a)
    ray.util.remove_placement_group(group)
    return seconds


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import ray

    import hora
    from hora.ray import RayExecutor

    print(f"load before: {load()}   date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    t = time.perf_counter()
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    ray_init = time.perf_counter() - t
    settings = RayExecutor.create_settings(timeout_s=120, verbose=0)

    bare, starts, phases = [], [], []
    for _ in range(args.start_repeats):
        bare.append(bare_ray_start(ray, args.workers))
        executor = RayExecutor(settings, num_workers=args.workers, cpus_per_worker=1)
        executor.start()
        starts.append(executor.start_timings["total"])
        phases.append(executor.start_timings)
        executor.shutdown()

    models = str(REPO / "examples" / "torch" / "models.py")
    block = (args.steps, args.warmup, args.batch, models)
    executor = None
    env = {"OMP_NUM_THREADS": "1"}
    rates: dict[str, list[float]] = {"ray": [], "gloo": []}
    order = ["ray", "gloo", "gloo", "ray"]
    for i in range(args.blocks * 2):
        engine = order[i % 4]
        if engine == "ray":
            if executor is None:
                executor = RayExecutor(settings, num_workers=args.workers, cpus_per_worker=1)
                executor.start()
            results = executor.run(mlp_block, args=list(block))
            if not args.reuse:
                executor.shutdown()
                executor = None
        else:
            results = hora.run(mlp_block, args=block, np=args.workers, use_gloo=True, env=env)
        rates[engine].append(results[0]["samples_per_s"])
        cpu = " ".join(f"{r['cpu_s']:.2f}" for r in results)
        print(f"  block {i + 1:2d} {engine:4s} {results[0]['samples_per_s']:9.1f} samples/s, CPU s per rank {cpu}"
              f"   load {load()}", flush=True)
    if executor is not None:
        executor.shutdown()
    ray.shutdown()

    ratios = [r / g for r, g in zip(rates["ray"], rates["gloo"], strict=True)]
    med = statistics.median
    figures = {
        "workers": args.workers, "ray_init_s": ray_init,
        "start_s": starts, "bare_ray_s": bare, "start_phases": phases,
        "rates": rates, "ratio_median": med(ratios), "ratios": ratios, "load_after": load(),
    }
    print(f"\nray.init (local, {args.num_cpus} CPUs): {ray_init:.2f} s")
    print(f"{'':32s} {'median':>8s} {'min':>8s} {'max':>8s}")
    print(f"{'executor.start() -> all ready':32s} {med(starts):8.3f} {min(starts):8.3f} {max(starts):8.3f}  s")
    print(f"{'bare Ray: group + actors + ping':32s} {med(bare):8.3f} {min(bare):8.3f} {max(bare):8.3f}  s")
    for name in ("placement_group", "actors", "setup"):
        values = [p[name] for p in phases]
        print(f"{'  of which ' + name:32s} {med(values):8.3f} {min(values):8.3f} {max(values):8.3f}  s")
    print(f"\nMLP {'-'.join(map(str, MLP_SIZES))}, batch {args.batch}/rank, {args.workers} ranks, "
          f"{args.steps} steps per block, {args.blocks} blocks each (ABBA):")
    for engine in ("ray", "gloo"):
        values = rates[engine]
        label = "RayExecutor.run" if engine == "ray" else "hora.run (hora run --gloo)"
        print(f"  {label:28s} {med(values):9.1f} samples/s (min {min(values):.1f}, max {max(values):.1f})")
    print(f"  ratio Ray / hora run --gloo, median of pairs: {med(ratios):.3f} "
          f"(pairs {', '.join(f'{r:.3f}' for r in ratios)})")
    print(f"load after: {figures['load_after']}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
