"""Failures end in clear errors within a bound, never a hang."""

from __future__ import annotations

import re
import sys
import time

import pytest


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_stall_deadline_raises_on_every_rank(run_job, controller):
    start = time.monotonic()
    proc = run_job(3, [sys.executable, "tests/scripts/stall.py"], mpi=controller == "mpi", timeout=90,
                   env={"HORA_STALL_CHECK_TIME_SECONDS": "1", "HORA_STALL_SHUTDOWN_TIME_SECONDS": "3"})
    assert time.monotonic() - start < 60
    out = proc.stdout
    for rank in range(3):
        line = next((ln for ln in out.splitlines() if ln.startswith(f"[{rank}]<stdout>:STALL")), None)
        assert line is not None, f"rank {rank} did not raise StallError:\n{out[-3000:]}\n{proc.stderr[-3000:]}"
        assert float(re.search(r"after ([0-9.]+)s", line).group(1)) < 20
    # the report names who is missing for each tensor
    assert "'only.rank0': submitted by ranks [0], missing ranks [1, 2]" in out + proc.stderr


def test_dead_peer_gives_error_and_root_cause(run_job):
    start = time.monotonic()
    proc = run_job(2, [sys.executable, "tests/scripts/dead_peer.py"], timeout=90)
    assert time.monotonic() - start < 45
    assert proc.returncode == 7, proc.stderr[-2000:]
    assert "root cause: rank 1" in proc.stderr and "exited with code 7" in proc.stderr


def test_dead_peer_during_fp16_cast_exchange_ends_the_job(run_job):
    """A rank lost while the others wait on the fp16 chunks of hora.torch's cast exchange: no hang."""
    start = time.monotonic()
    proc = run_job(3, [sys.executable, "tests/scripts/dead_peer_fp16.py"], timeout=120)
    assert time.monotonic() - start < 60, "the survivors hung on the cast exchange"
    assert proc.returncode == 7, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "root cause: rank 2" in proc.stderr and "exited with code 7" in proc.stderr
    assert "NO ERROR" not in proc.stdout


RAISES_WHILE_PEER_WORKS = """
import time
import hora.torch as hvd
hvd.init()
if hvd.rank() == 1:
    raise RuntimeError("rank 1 gives up")
time.sleep(60)  # a long step: the job must not wait for it to end
"""


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_a_rank_that_raises_ends_the_job_while_a_peer_is_busy(run_job, controller, tmp_path):
    # Under MPI the raising rank would otherwise wait in MPI_Finalize for its busy peer (mpi4py finalizes at exit).
    script = tmp_path / "raises.py"
    script.write_text(RAISES_WHILE_PEER_WORKS)
    start = time.monotonic()
    proc = run_job(2, [sys.executable, str(script)], mpi=controller == "mpi", timeout=90)
    assert time.monotonic() - start < 30, proc.stderr[-2000:]
    assert proc.returncode != 0
    assert "root cause: rank 1" in proc.stderr and "RuntimeError: rank 1 gives up" in proc.stderr
