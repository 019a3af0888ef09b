"""Recovery after a lost rank: hora's elastic mode against torchrun's elastic agent, in the same run.

Both jobs train the MLP 784-1024-1024-10 on 4 local processes with synthetic
data (a fixed random teacher labels Gaussian inputs, so the loss falls), and
keep a restart point every ``--commit-every`` steps: hora with
``hvd.elastic.TorchState.commit()`` (in memory), torchrun with a checkpoint
file written by rank 0 (DDP over gloo, ``--nnodes 1:1 --max-restarts 3``,
restarting from the last checkpoint).  At step ``--kill-step`` of the first
attempt, the rank started as rank 3 SIGKILLs itself.  Measured from the logs
every rank writes (one line per completed step):

* recovery: from the kill to the first step completed afterwards by any survivor;
* steps lost: the last step completed before the kill minus the step training
  resumed from (at most the commit interval);
* the loss of the last step before the kill and of the first step after it,
  to show that the curve continues from the commit instead of starting over.

hora runs its 4 ranks as 4 one-slot "hosts" (127.0.0.1 .. 127.0.0.4, all this
machine), so the killed rank's host is blacklisted and 3 ranks go on; torchrun
restarts all 4.  Run::

    python benchmarks/elastic.py                # both, prints a table
    python benchmarks/elastic.py --json out.json

``--host-loss`` measures the other failure, a host that vanishes without a
word: 3 hosts of an emulated cluster (:mod:`hora.testing.emulate`, needs
root), one rank each, ``-H h1:1,h2:1,h3:1 --min-np 2``; at step
``--kill-step`` h3's link is cut (:func:`hora.testing.partition.cut`: no FIN,
no RST).  Recovery runs from the cut to the first step a survivor completes
afterwards; the driver notices the silence after ``HORA_HEARTBEAT_TIMEOUT``
and tells the survivors to leave the ring::

    python benchmarks/elastic.py --host-loss
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HIDDEN = 1024


# --------------------------------------------------------------------------- the training job (both modes)


def _model_and_data(seed: int = 0):
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(784, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN),
                                torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 10))
    teacher = torch.randn(784, 10, generator=torch.Generator().manual_seed(99))
    return model, teacher


def _batch(step: int, rank: int, batch: int, teacher):
    import torch

    g = torch.Generator().manual_seed(1000003 * step + rank)
    x = torch.randn(batch, 784, generator=g)
    return x, (x @ teacher).argmax(1)


def _log_step(logdir: str, tag: str, rank: int, step: int, loss: float) -> None:
    with open(os.path.join(logdir, f"steps.{os.getpid()}.{tag}"), "a") as f:
        f.write(f"{time.time():.6f} {step} {loss:.6f} {rank}\n")


def _maybe_kill(args, start_rank: int, step: int, first_attempt: bool) -> None:
    if first_attempt and start_rank == 3 and step == args.kill_step:
        with open(os.path.join(args.logdir, "killed"), "w") as f:
            f.write(f"{time.time():.6f}")
        os.kill(os.getpid(), signal.SIGKILL)


def worker_hora(args) -> None:
    import torch
    import torch.nn.functional as F

    import hora.torch as hvd

    hvd.init()
    start_rank = int(os.environ.get("HOROVOD_RANK", "0"))
    model, teacher = _model_and_data()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, opt, step=0)

    @hvd.elastic.run
    def train(state):
        while state.step < args.steps:
            _maybe_kill(args, start_rank, state.step, True)
            x, y = _batch(state.step, hvd.rank(), args.batch, teacher)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            state.step += 1
            _log_step(args.logdir, "hora", hvd.rank(), state.step, loss.item())
            if state.step % args.commit_every == 0:
                state.commit()

    train(state)
    hvd.shutdown()


def worker_ddp(args) -> None:
    import faulthandler

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    stacks = open(os.path.join(args.logdir, f"stacks.{os.getpid()}"), "w")  # noqa: SIM115 - lives as long as the worker
    faulthandler.dump_traceback_later(120, file=stacks)  # where a stuck worker waits
    # A restarted group hangs in gloo's connect when it rendezvous under the first attempt's keys of the
    # agent's store (torch 2.13, CPU): give each attempt its own prefix.
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"bench/{restart}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    rank = dist.get_rank()
    first_attempt = restart == "0"
    model, teacher = _model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    ckpt = os.path.join(args.logdir, "ddp.ckpt")
    step = 0
    if os.path.exists(ckpt):
        saved = torch.load(ckpt)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        step = saved["step"]
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    while step < args.steps:
        _maybe_kill(args, rank, step, first_attempt)
        x, y = _batch(step, rank, args.batch, teacher)
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        step += 1
        _log_step(args.logdir, "ddp", rank, step, loss.item())
        if step % args.commit_every == 0 and rank == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


# --------------------------------------------------------------------------- the driver


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HORA_", "HOROVOD_", "OMPI_", "PMIX_", "MASTER_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(REPO)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _analyse(logdir: str, tag: str, commit_every: int) -> dict[str, float]:
    with open(os.path.join(logdir, "killed")) as f:
        killed = float(f.read())
    rows = []
    for path in glob.glob(os.path.join(logdir, f"steps.*.{tag}")):
        with open(path) as f:
            rows += [(float(t), int(s), float(loss), int(r)) for t, s, loss, r in (line.split() for line in f)]
    before = [r for r in rows if r[0] <= killed]
    after = sorted(r for r in rows if r[0] > killed)
    last_before = max(before, key=lambda r: r[1])
    # Survivors may still log the step every rank had finished when the peer died; training has resumed
    # at the first step after the kill numbered at most one past the last restart point.
    restart_point = last_before[1] // commit_every * commit_every
    first = next(r for r in after if r[1] <= restart_point + 1)
    # The same rank at the same step before the kill: its data and (restored) weights are the same.
    same_step = [r for r in before if r[1] == first[1] and r[3] == first[3]]
    return {
        "recovery_s": first[0] - killed,
        "steps_lost": last_before[1] - (first[1] - 1),
        "last_step_before_kill": last_before[1],
        "resumed_at_step": first[1],
        "loss_before_kill": last_before[2],
        "loss_after_resume": first[2],
        "loss_same_step_first_run": same_step[0][2] if same_step else float("nan"),
        "loss_at_step_1": min(rows, key=lambda r: (r[1], r[0]))[2],
        "total_s": max(r[0] for r in rows) - min(r[0] for r in rows),
    }


def _run_job(name: str, cmd_for: Callable[[str], list[str]], tag: str, args, env: dict[str, str]) -> dict[str, float]:
    """Run one job with its own log directory and analyse its step logs."""
    logdir = tempfile.mkdtemp(prefix=f"{name}-elastic-bench-")
    start = time.time()
    proc = subprocess.run(cmd_for(logdir), env=env, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{name} job failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    out = _analyse(logdir, tag, args.commit_every)
    out["wall_s"] = time.time() - start
    shutil.rmtree(logdir, ignore_errors=True)
    return out


def run_hora(args, env: dict[str, str]) -> dict[str, float]:
    hosts = ",".join(f"127.0.0.{i + 1}:1" for i in range(4))
    return _run_job("hora", lambda logdir: [
        sys.executable, "-m", "hora.runner.cli", "run", "-np", "4", "--min-np", "2", "--max-np", "4", "-H", hosts,
        sys.executable, __file__, "--worker", "hora", *_worker_args(args, logdir)], "hora", args, env)


def run_torchrun(args, env: dict[str, str]) -> dict[str, float]:
    torchrun = shutil.which("torchrun", path=env["PATH"])
    if torchrun is None:
        raise SystemExit("torchrun is not on PATH")
    return _run_job("torchrun", lambda logdir: [
        torchrun, "--nnodes", "1:1", "--nproc-per-node", "4", "--max-restarts", "3", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", __file__, "--worker", "ddp", *_worker_args(args, logdir)],
        "ddp", args, env)


def run_host_loss(args, env: dict[str, str]) -> dict[str, float]:
    """hora on 3 emulated hosts, h3's link cut at step ``--kill-step`` (see the module docstring)."""
    from hora.testing.emulate import EmulatedCluster
    from hora.testing.partition import cut, restore

    logdir = tempfile.mkdtemp(prefix="hora-hostloss-bench-")
    os.chmod(logdir, 0o777)
    with EmulatedCluster(3) as cluster:
        cmd = [sys.executable, "-m", "hora.runner.cli", "run", "--ssh-config-file", cluster.ssh_config, "-np", "3",
               "--min-np", "2", "--max-np", "3", "-H", "h1:1,h2:1,h3:1", sys.executable, __file__, "--worker",
               "hora", *_worker_args(args, logdir)]
        start = time.time()
        proc = cluster.popen("h1", cmd, cwd=str(REPO), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
        try:
            deadline = time.monotonic() + args.timeout
            while _last_step(logdir) < args.kill_step:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the job ended or stalled before step {args.kill_step}")
                time.sleep(0.05)
            with open(os.path.join(logdir, "killed"), "w") as f:
                f.write(f"{time.time():.6f}")
            cut(cluster, "h3")
            _, stderr = proc.communicate(timeout=args.timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
            restore(cluster, "h3")
    if proc.returncode != 0:
        raise SystemExit(f"host-loss job failed ({proc.returncode}):\n{stderr[-3000:]}")
    out = _analyse(logdir, "hora", args.commit_every)
    out["wall_s"] = time.time() - start
    shutil.rmtree(logdir, ignore_errors=True)
    return out


def _last_step(logdir: str) -> int:
    last = 0
    for path in glob.glob(os.path.join(logdir, "steps.*.hora")):
        with open(path) as f:
            lines = f.read().splitlines()
        if lines and len(lines[-1].split()) == 4:
            last = max(last, int(lines[-1].split()[1]))
    return last


def _worker_args(args, logdir: str) -> list[str]:
    return ["--logdir", logdir, "--steps", str(args.steps), "--kill-step", str(args.kill_step),
            "--commit-every", str(args.commit_every), "--batch", str(args.batch), "--lr", str(args.lr)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--worker", choices=["hora", "ddp"], help=argparse.SUPPRESS)
    p.add_argument("--logdir", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=60, help="training steps (one 'epoch')")
    p.add_argument("--kill-step", type=int, default=25, help="the step at which rank 3 kills itself")
    p.add_argument("--commit-every", type=int, default=10, help="steps between commits / checkpoints")
    p.add_argument("--batch", type=int, default=64, help="batch per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--timeout", type=float, default=900, help="seconds each job may take")
    p.add_argument("--only", choices=["hora", "torchrun"], help="run one of the two")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--host-loss", action="store_true",
                   help="hora only: 3 emulated hosts, h3's link cut at --kill-step (needs root)")
    args = p.parse_args(argv)
    if args.worker == "hora":
        worker_hora(args)
        return 0
    if args.worker == "ddp":
        worker_ddp(args)
        return 0
    env = _clean_env()
    results: dict[str, dict[str, float]] = {}
    load = os.getloadavg()[0]
    if args.host_loss:
        results["hora host loss"] = run_host_loss(args, env)
    elif args.only in (None, "hora"):
        results["hora"] = run_hora(args, env)
    if args.only in (None, "torchrun") and not args.host_loss:
        results["torchrun"] = run_torchrun(args, env)
    what = "h3 of 3 emulated hosts cut off (no FIN/RST)" if args.host_loss else "rank 3 killed"
    print(f"elastic recovery ({what}), {3 if args.host_loss else 4} ranks, MLP 784-{HIDDEN}-{HIDDEN}-10, "
          f"commit every {args.commit_every} steps, "
          f"at step {args.kill_step}; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"1-min load {load:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"{'':15}{'recovery s':>12}{'steps lost':>12}{'resumed at':>12}{'loss step 1':>13}{'loss at kill':>14}"
          f"{'loss resumed':>14}{'same step, 1st run':>20}{'wall s':>9}")
    for name, r in results.items():
        print(f"{name:15}{r['recovery_s']:12.2f}{r['steps_lost']:12d}{r['resumed_at_step']:12d}"
              f"{r['loss_at_step_1']:13.4f}{r['loss_before_kill']:14.4f}{r['loss_after_resume']:14.4f}"
              f"{r['loss_same_step_first_run']:20.4f}{r['wall_s']:9.1f}")
    if "hora" in results and "torchrun" in results:
        ratio = results["hora"]["recovery_s"] / results["torchrun"]["recovery_s"]
        print(f"hora recovery / torchrun recovery = {ratio:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
