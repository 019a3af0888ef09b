"""Elastic training across the emulated cluster: a host dies mid-training, training goes on, the host comes back.

3 hosts x 2 slots under ``hora run --host-discovery-script``, whose script
lists the hosts that answer ssh.  The test kills every process of h3 and
stops (SIGSTOP) its sshd: h3's workers are lost, h3 is blacklisted for a
short cool-down and then no longer discovered, and training continues on 4
ranks.  Then sshd continues: h3 is discovered again, re-admitted with two new
workers, and the job ends on 6 ranks with the same weights on every rank.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.netns, pytest.mark.slow]

TRAIN = Path(__file__).parents[1] / "elastic" / "scripts" / "elastic_train.py"


def _pids_in(cluster, host) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True, timeout=30).stdout
    return [int(p) for p in out.split() if int(p) != host.pid]


def _sizes(log: Path) -> list[int]:
    if not log.exists():
        return []
    return [json.loads(line)["size"] for line in log.read_text().splitlines() if line.strip()]


def _wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen, stderr: Path) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the job ended ({proc.returncode}) while waiting for {what}:\n"
                                 f"{stderr.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:g} s")
        time.sleep(0.5)


@pytest.mark.timeout(1500)
def test_a_host_dies_training_continues_and_the_host_is_readmitted(cluster, popen_on_h1, tmp_path):
    discover = tmp_path / "discover.sh"
    discover.write_text(
        "#!/bin/sh\n"
        "for h in h1 h2 h3; do\n"
        f"  timeout 20 ssh -F {cluster.ssh_config} -o BatchMode=yes -o ConnectTimeout=15 $h true >/dev/null 2>&1 "
        "&& echo $h:2\n"
        "done\n"
        "exit 0\n")
    discover.chmod(discover.stat().st_mode | stat.S_IXUSR)
    log, weights, stop = tmp_path / "log.jsonl", tmp_path / "weights.jsonl", tmp_path / "stop"
    stderr_path = tmp_path / "stderr"
    stderr_file = stderr_path.open("w")
    proc = popen_on_h1(
        "-np", "6", "--min-np", "4", "--max-np", "6", "--host-discovery-script", str(discover),
        "--blacklist-cooldown-range", "5", "10", "--elastic-timeout", "300",
        sys.executable, str(TRAIN), "--logfile", str(log), "--weights-file", str(weights), "--epochs", "1000",
        "--batches-per-epoch", "5", "--batch-wait", "0.2", "--stop-file", str(stop),
        stdout=subprocess.DEVNULL, stderr=stderr_file)
    h3 = cluster.host("h3")
    try:
        _wait_for(lambda: 6 in _sizes(log), 600, "epoch on 6 ranks", proc, stderr_path)
        for pid in _pids_in(cluster, h3):  # h3's workers, the shells around them and their ssh sessions
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.kill(h3.pid, signal.SIGSTOP)  # and its sshd stops answering
        seen = len(_sizes(log))
        _wait_for(lambda: 4 in _sizes(log)[seen:], 300, "epoch on the 4 surviving ranks", proc, stderr_path)
        os.kill(h3.pid, signal.SIGCONT)
        seen = len(_sizes(log))
        _wait_for(lambda: 6 in _sizes(log)[seen:], 600, "epoch on 6 ranks after h3 came back", proc, stderr_path)
        stop.touch()
        proc.wait(timeout=300)
    finally:
        os.kill(h3.pid, signal.SIGCONT)
        stderr_file.close()
    assert proc.returncode == 0, stderr_path.read_text()[-4000:]
    digests = [json.loads(line) for line in weights.read_text().splitlines()]
    assert sorted(d["rank"] for d in digests) == list(range(6)), digests
    assert len({d["digest"] for d in digests}) == 1, digests
