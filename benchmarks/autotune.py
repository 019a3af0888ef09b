"""Autotune against a grid sweep of the same knobs, in one job: does it find a setting as good as the best?

For each hora controller and each workload (the ResNet-50 gradient set and
the MLP of ``allreduce.py``):

1. **grid sweep**: every candidate of :data:`hora.core.autotune.SPACE` (or
   ``--space``, in ``HORA_AUTOTUNE_SPACE`` syntax) is set on every rank
   (``Engine.retune`` between barriers), run for one untimed step and timed
   for ``--sweep-steps`` steps;
2. **autotune**: the engine starts from its defaults with rank 0's
   :class:`~hora.core.autotune.Autotuner` on (as ``--autotune`` would) and
   the workload runs ``--tune-steps`` steps; the step at which it settled
   and its choice are recorded (its CSV goes to ``--log-dir``);
3. **steady state**: the tuned setting and the grid's best setting are timed
   in alternating blocks of ``--block-steps`` steps (balanced order), and
   the ratio tuned ÷ best is the median of the per-cycle ratios of their
   step rates (1.0: as good as the best fixed setting).

Launch on 2 ranks::

    hora run -np 2 --mpi python benchmarks/autotune.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from allreduce import gradset_hora_cases, mlp_setup, open_hora, resnet50_gradients, sgd_step
from common import markdown_table, median, start_world, time_interleaved

from hora.core import autotune
from hora.core import runtime as hora_runtime

MiB = 1 << 20


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hora-controllers", default="mpi,gloo", help="comma-separated controllers to measure")
    p.add_argument("--workloads", default="gradset,mlp", help="comma-separated: gradset, mlp")
    p.add_argument("--space", default="", help="candidates in HORA_AUTOTUNE_SPACE syntax (default: the full grid)")
    p.add_argument("--sweep-steps", type=int, default=4, help="timed steps per grid candidate")
    p.add_argument("--tune-steps", type=int, default=300, help="steps autotune may take")
    p.add_argument("--steps-per-sample", type=int, default=10)
    p.add_argument("--max-samples", type=int, default=20)
    p.add_argument("--block-steps", type=int, default=10, help="steps per block of the steady-state comparison")
    p.add_argument("--repeats", type=int, default=6, help="blocks of each in the steady-state comparison")
    p.add_argument("--mlp-batch-size", type=int, default=128)
    p.add_argument("--log-dir", default=None, help="where the autotune CSV logs go (default: a temporary dir)")
    return p.parse_args()


def workload(hvd, name: str, args: argparse.Namespace) -> Callable[[], None]:
    """One training step of a workload."""
    if name == "gradset":
        return gradset_hora_cases(hvd, resnet50_gradients())["async ×161 + synchronize"]
    model, x, y = mlp_setup(args.mlp_batch_size)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), op=hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return lambda: sgd_step(model, opt, x, y)


def describe(s: autotune.Settings) -> str:
    direct = "backend" if s.direct_threshold_bytes is None else f"{s.direct_threshold_bytes / MiB:g}M"
    return (f"fusion {s.fusion_threshold_bytes / MiB:g}M, cycle {s.cycle_time_ms:g}ms, direct {direct}, "
            f"overlap {'on' if s.overlap else 'off'}")


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    world = start_world()
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="hora-autotune-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    space = autotune.parse_space(args.space) if args.space else autotune.SPACE
    rows, grids = [], []
    for controller in filter(None, args.hora_controllers.split(",")):
        for name in args.workloads.split(","):
            hvd, why = open_hora(world, controller)
            if hvd is None:
                print(why, file=sys.stderr)
                break
            engine = hora_runtime.current().engine
            default = autotune.start_settings(engine.config, engine.overlap)
            step = workload(hvd, name, args)

            def use(s: autotune.Settings, engine=engine) -> None:
                world.barrier()
                engine.retune(**s.knobs())
                world.barrier()

            # 1. grid sweep
            started = time.perf_counter()
            rates: dict[autotune.Settings, float] = {}
            for s in space:
                use(s)
                step()
                world.barrier()
                t0 = time.perf_counter()
                for _ in range(args.sweep_steps):
                    step()
                rates[s] = args.sweep_steps / world.allmax([time.perf_counter() - t0])[0]
            best = max(rates, key=rates.get)
            sweep_s = time.perf_counter() - started
            # 2. autotune from the defaults
            use(default)
            log_file = log_dir / f"{controller}-{name}.csv"
            if world.rank == 0:
                engine.autotune = autotune.Autotuner(
                    default, candidates=space, steps_per_sample=args.steps_per_sample, warmup_samples=1,
                    max_samples=args.max_samples, log_file=str(log_file))
            world.barrier()
            started = time.perf_counter()
            taken = None
            for i in range(args.tune_steps):
                step()
                if taken is None and world.rank == 0 and engine.autotune.done:
                    taken = i + 1
            tune_s = time.perf_counter() - started
            tuner = engine.autotune if world.rank == 0 else None
            chosen, settled = world.bcast((tuner.chosen, tuner.steps) if tuner is not None and tuner.done
                                          else (None, None))
            engine.autotune = None
            # 3. steady state: tuned vs the grid's best, in alternating blocks
            ratio = None
            if chosen is not None:
                def block(s: autotune.Settings, engine=engine, step=step) -> Callable[[], None]:
                    def run() -> None:
                        engine.retune(**s.knobs())
                        world.barrier()
                        for _ in range(args.block_steps):
                            step()
                    return run

                times = time_interleaved(world, {"tuned": block(chosen), "best": block(best)}, 1, args.repeats)
                ratio = median([b / t for t, b in zip(times["tuned"], times["best"], strict=True)])
            grids.append((controller, name, rates))
            rows.append([controller, name, str(len(space)), describe(best), f"{rates[best]:.2f}",
                         describe(chosen) if chosen else "not settled", f"{rates.get(chosen, float('nan')):.2f}"
                         if chosen else "-", str(settled) if settled else f">{args.tune_steps}",
                         f"{ratio:.3f}" if ratio else "-", f"{sweep_s:.0f} / {tune_s:.0f}"])
            if world.rank == 0:
                print(f"[autotune] {controller} {name}: best {describe(best)} {rates[best]:.2f} steps/s; tuned "
                      f"{describe(chosen) if chosen else '-'} after {settled} steps; tuned/best {ratio}", flush=True)
            hvd.shutdown()
    if world.rank == 0:
        print(markdown_table(["controller", "workload", "grid", "best fixed (sweep)", "steps/s", "autotune's choice",
                              "its sweep steps/s", "steps to settle", "tuned ÷ best, paired steady state",
                              "sweep / tune s"], rows))
        for controller, name, rates in grids:
            top = sorted(rates.items(), key=lambda kv: -kv[1])
            print(f"\n{controller} {name}: grid sweep, steps/s (top 5, bottom 2)")
            for s, r in top[:5] + top[-2:]:
                print(f"  {r:8.2f}  {describe(s)}")
        print(f"\nautotune logs: {log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
