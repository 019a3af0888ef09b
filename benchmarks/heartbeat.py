"""False alarms of the host-loss heartbeat: the longest silence between beats on this machine, as it is loaded now.

Starts ``--agents`` ssh-launcher agents on this machine in watch mode (as
``hora run --mpi`` does on each other host), beats to them as the launcher
does, and records the gaps between the beats each agent sends back, for
``--seconds``.  A gap longer than ``HORA_HEARTBEAT_TIMEOUT`` would have been a
false alarm.  Prints the longest gap, the 99.9th percentile, and how many
gaps exceeded the deadline, with the machine's load average.

    python benchmarks/heartbeat.py --agents 3 --seconds 300
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import threading
import time

from hora.config import HeartbeatConfig
from hora.runner.agent import MARKER
from hora.runner.ssh import agent_command


def _gaps(proc: subprocess.Popen, until: float, out: list[float]) -> None:
    last = None
    for line in iter(proc.stdout.readline, b""):  # type: ignore[union-attr]
        if not line.startswith(MARKER) or b'"beat"' not in line:
            continue
        now = time.monotonic()
        if last is not None:
            out.append(now - last)
        last = now
        if now >= until:
            return


def main() -> None:
    """Run the measurement and print one table row."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=120.0)
    args = parser.parse_args()
    config = HeartbeatConfig.from_env()
    procs = [subprocess.Popen(["sh", "-c", agent_command(os.environ.get("PATH"))], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE) for _ in range(args.agents)]
    spec = {"op": "spec", "cwd": "/", "env": {}, "processes": [], "watch": True,
            "heartbeat": [config.interval_s, config.timeout_s]}
    for proc in procs:
        proc.stdin.write((json.dumps(spec) + "\n" + json.dumps({"op": "start"}) + "\n").encode())  # type: ignore
        proc.stdin.flush()  # type: ignore[union-attr]
    until = time.monotonic() + args.seconds
    gaps: list[list[float]] = [[] for _ in procs]
    readers = [threading.Thread(target=_gaps, args=(proc, until, per), daemon=True)
               for proc, per in zip(procs, gaps, strict=True)]
    for reader in readers:
        reader.start()
    while time.monotonic() < until:  # the launcher's beats, from this (loaded) process
        for proc in procs:
            proc.stdin.write(b'{"op": "beat"}\n')  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
        time.sleep(config.interval_s)
    for reader in readers:
        reader.join(config.timeout_s * 2)
    for proc in procs:
        proc.stdin.close()  # type: ignore[union-attr]
        proc.wait(timeout=30)
    every = sorted(g for per in gaps for g in per)
    load = os.getloadavg()
    p999 = every[min(len(every) - 1, int(len(every) * 0.999))]
    print(f"{time.strftime('%Y-%m-%d %H:%M')} load {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}: "
          f"{args.agents} agents x {args.seconds:g} s, interval {config.interval_s:g} s: {len(every)} gaps, "
          f"longest {every[-1]:.2f} s, p99.9 {p999:.2f} s, over the {config.timeout_s:g} s deadline: "
          f"{sum(g > config.timeout_s for g in every)}")


if __name__ == "__main__":
    main()
