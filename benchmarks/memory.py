"""Peak resident memory per rank: hora's DistributedOptimizer against DDP, each in a fresh job.

The issue's memory target compares "the same script under DDP", so every
(engine, workload) pair runs as its own 2-rank job: no engine's leftovers
inflate another's peak.  Workloads:

* ``mlp``: the 784-1024-1024-10 MLP of ``allreduce.py``, batch 128 per rank.
* ``resnet50``: ResNet-50 (161 gradient tensors, 97.5 MiB), batch 2 at 64x64.

Each rank reports ``VmHWM`` (peak RSS) after warm-up plus a few steps, and
the RSS just before the model is built (libraries and process group loaded).
The allowance is the target's: DDP's peak + the fusion buffer + 10% of the
gradients' bytes.

    python benchmarks/memory.py                      # all engines x workloads, a markdown table
    python benchmarks/memory.py --json memory.json

Memory is not time: these figures do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ENGINES = ("ddp", "hora-gloo", "hora-mpi")
WORKLOADS = ("mlp", "resnet50")
HERE = Path(__file__).resolve().parent


def child(engine: str, workload: str, steps: int) -> None:
    """One rank of one job: build, train ``steps`` steps, print a JSON line."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(HERE))
    from common import current_rss_mib, load_example_models, peak_rss_mib, same_allocator_for_every_peer

    same_allocator_for_every_peer()  # DDP gets the malloc thresholds hora's init sets
    torch.set_num_threads(1)
    if engine == "ddp":
        import torch.distributed as dist

        rank, size = int(os.environ["HORA_RANK"]), int(os.environ["HORA_SIZE"])
        addr, port = os.environ["HORA_RENDEZVOUS_ADDR"], int(os.environ["HORA_RENDEZVOUS_PORT"]) + 1
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=size)
    else:
        import hora.torch as hvd

        hvd.init()
        rank = hvd.rank()
    before = current_rss_mib()

    models = load_example_models()
    torch.manual_seed(0)
    if workload == "mlp":
        model = models.MLP((784, 1024, 1024, 10))
        x, y = torch.randn(128, 784), torch.randint(0, 10, (128,))
    else:
        model = models.resnet50(num_classes=10)
        x, y = torch.randn(2, 3, 64, 64), torch.randint(0, 10, (2,))
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if engine == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    print(json.dumps({"rank": rank, "peak_mib": peak_rss_mib(), "before_model_mib": before,
                      "grad_bytes": grad_bytes}), flush=True)
    if engine != "ddp":
        hvd.shutdown()


def run_job(engine: str, workload: str, steps: int, np_: int) -> list[dict]:
    """Launch one fresh ``hora run`` job and collect each rank's JSON line."""
    controller = "--mpi" if engine == "hora-mpi" else "--gloo"
    cmd = [sys.executable, "-m", "hora.runner.cli", "run", "-np", str(np_), controller, sys.executable,
           str(Path(__file__).resolve()), "--child", engine, workload, "--steps", str(steps)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{engine}/{workload} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    rows = []
    for line in out.stdout.splitlines():
        _, _, payload = line.partition(":")
        if payload.startswith("{"):
            rows.append(json.loads(payload))
    return sorted(rows, key=lambda r: r["rank"])


def main(argv: list[str] | None = None) -> int:
    """Run every (engine, workload) job and print the table against the target."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--child", nargs=2, metavar=("ENGINE", "WORKLOAD"), help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=20, help="training steps per job")
    p.add_argument("-np", type=int, default=2, dest="np_", help="ranks per job")
    p.add_argument("--fusion-mb", type=float, default=64.0, help="fusion buffer size, for the allowance")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    if args.child:
        child(args.child[0], args.child[1], args.steps)
        return 0

    results: dict[str, dict[str, list[dict]]] = {}
    for workload in WORKLOADS:
        for engine in ENGINES:
            results.setdefault(workload, {})[engine] = run_job(engine, workload, args.steps, args.np_)
            print(f"{workload} {engine}: peak {[round(r['peak_mib']) for r in results[workload][engine]]} MiB",
                  file=sys.stderr, flush=True)
    print("| workload | engine | peak RSS MiB (per rank) | before model MiB | − DDP MiB | allowance MiB | within? |")
    print("|:---|:---|---:|---:|---:|---:|:---|")
    for workload, by_engine in results.items():
        ddp = max(r["peak_mib"] for r in by_engine["ddp"])
        grads = by_engine["ddp"][0]["grad_bytes"] / 2**20
        allowance = args.fusion_mb + 0.1 * grads
        for engine, rows in by_engine.items():
            peak = max(r["peak_mib"] for r in rows)
            extra = peak - ddp
            within = "—" if engine == "ddp" else ("yes" if extra <= allowance else "no")
            print(f"| {workload} | {engine} | {'/'.join(str(round(r['peak_mib'])) for r in rows)} | "
                  f"{'/'.join(str(round(r['before_model_mib'])) for r in rows)} | "
                  f"{'—' if engine == 'ddp' else f'{extra:+.0f}'} | {allowance:.0f} | {within} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
