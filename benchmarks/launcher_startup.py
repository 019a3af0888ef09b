"""Start-up time of a job: from ``hora run`` to the first allreduce, under the sge and the ssh launcher.

Both run on the same emulated 3-host cluster (root, network namespaces; a
Son of Grid Engine on it, see :meth:`hora.testing.emulate.EmulatedCluster.start_sge`)
with 6 ranks, 2 a host, alternating launcher by launcher.  The clock starts
in the shell that runs ``hora run`` on h1 (inside the grid-engine job for
sge, so the queueing time of the job is not counted) and stops when rank 0
has its first allreduce's result; both clocks are this machine's.

    python benchmarks/launcher_startup.py --repeat 5

prints a markdown table: the median and range of each launcher's start-up
time and their ratio (target: sge / ssh <= 1.5).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from hora.testing.emulate import EmulatedCluster

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
RANK = (
    "import time, torch, hora.torch as hvd; hvd.init(); hvd.allreduce(torch.ones(4), name='first'); "
    "hvd.rank() == 0 and print('FIRST', time.time(), flush=True); hvd.shutdown()"
)


def job_env(base: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in base.items() if not k.startswith(("HORA_", "HOROVOD_", "OMPI_", "PMIX_", "DMLC_"))}
    env.pop("OMP_NUM_THREADS", None)
    env["PYTHONPATH"] = str(REPO)
    env["PATH"] = f"{Path(PY).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def startup(text: str) -> float:
    """Seconds between the ``T0`` and ``FIRST`` lines of a job's output."""
    t0 = first = None
    for line in text.splitlines():
        words = line.replace("<stdout>:", " ").split()
        if "T0" in words:
            t0 = float(words[words.index("T0") + 1])
        if "FIRST" in words:
            first = float(words[words.index("FIRST") + 1])
    if t0 is None or first is None:
        raise RuntimeError(f"no T0/FIRST in the job's output:\n{text[-2000:]}")
    return first - t0


def run_ssh(cluster: EmulatedCluster, env: dict[str, str]) -> float:
    hora = [PY, "-m", "hora.runner.cli", "run", "-np", "6", "-H", cluster.hosts_spec(2), "--ssh-config-file",
            cluster.ssh_config, PY, "-c", RANK]
    script = f"echo T0 $(date +%s.%N); exec {shlex.join(hora)}"
    result = cluster.run("h1", ["sh", "-c", script], env=env, cwd=str(REPO), timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"ssh job failed: {result.stderr[-2000:]}")
    return startup(result.stdout)


def run_sge(cluster: EmulatedCluster, env: dict[str, str], directory: str) -> float:
    hora = [PY, "-m", "hora.runner.cli", "run", "-np", "6", PY, "-c", RANK]
    script = f"echo T0 $(date +%s.%N); exec {shlex.join(hora)}"
    out = os.path.join(directory, f"sge-{time.monotonic_ns()}.out")
    command = ["qsub", "-sync", "y", "-V", "-cwd", "-b", "y", "-pe", "hora", "6", "-j", "y", "-o", out,
               "sh", "-c", shlex.quote(script)]
    result = cluster.run("h1", command, env=env, cwd=str(REPO), timeout=300)
    with open(out, encoding="utf-8") as f:
        text = f.read()
    if result.returncode != 0:
        raise RuntimeError(f"sge job failed: {result.stdout[-500:]} {text[-2000:]}")
    return startup(text)


def main() -> int:
    """Run the comparison and print its table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeat", type=int, default=5, help="jobs per launcher (alternating)")
    args = parser.parse_args()
    times: dict[str, list[float]] = {"ssh": [], "sge": []}
    with EmulatedCluster(3) as cluster, tempfile.TemporaryDirectory(prefix="hora-startup") as directory:
        env = job_env(cluster.start_sge(slots_per_host=2))
        run_ssh(cluster, env)  # warm the page cache (torch's import) before anything is timed
        for _ in range(args.repeat):
            times["ssh"].append(run_ssh(cluster, env))
            times["sge"].append(run_sge(cluster, env, directory))
    load = os.getloadavg()
    print(f"start-up from hora run to rank 0's first allreduce, 6 ranks on 3 emulated hosts, {args.repeat} runs "
          f"each, alternating; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n")
    print("| launcher | median s | min s | max s |\n|---|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.2f} | {min(values):.2f} | {max(values):.2f} |")
    ratio = statistics.median(times["sge"]) / statistics.median(times["ssh"])
    print(f"\nsge / ssh (medians): {ratio:.2f} (target <= 1.5)")
    print("runs:", {k: [round(v, 2) for v in vs] for k, vs in times.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
