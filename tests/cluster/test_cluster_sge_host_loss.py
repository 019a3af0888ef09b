"""Under the grid engine, a host whose link is cut (no FIN, no RST) ends a PE job within 15 s, naming it.

A parallel job of 6 slots (2 on each of h1, h2, h3; the master task on h1)
runs ``hora run -np 6``: the sge launcher's agents, reached with ``qrsh
-inherit``, beat over that channel as the ssh launcher's do.  h3's veth
leaves the bridge (:func:`hora.testing.partition.cut`); hora run must end
within 15 s of the cut, non-zero, with a root cause naming h3.  Every wait
is bounded.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from hora.testing.partition import cut, restore
from tests.cluster.test_cluster_host_loss import LOOP
from tests.cluster.test_cluster_sge import PY, REPO, job_env, sge  # noqa: F401 - sge: the module's grid engine

pytestmark = [pytest.mark.netns, pytest.mark.slow]


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _poll(predicate, timeout: float) -> float | None:
    """When ``predicate()`` first held (checked every 0.1 s), or None after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        time.sleep(0.1)
    return None


@pytest.mark.timeout(400)
def test_a_host_cut_off_ends_the_pe_job_within_15_s_naming_it(cluster, sge, tmp_path):  # noqa: F811
    out, err = tmp_path / "job.out", tmp_path / "job.err"
    # The shell says when hora run itself ended: qsub -sync y also waits for the grid engine to hear of h3.
    script = f"{PY} -m hora.runner.cli run -np 6 {PY} {LOOP}; echo hora-rc=$? >&2"
    command = ["qsub", "-sync", "y", "-V", "-cwd", "-b", "y", "-pe", "hora", "6", "-masterq", "all.q@h1",
               "-o", str(out), "-e", str(err), "sh", "-c", shlex.quote(script)]
    job = cluster.popen("h1", command, env=job_env(sge), cwd=str(REPO), stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL)
    try:
        stepped = _poll(lambda: len(set(re.findall(r"<stdout>:step \d+ (\d+) ", _read(out)))) == 6, 240)
        assert stepped, f"not every rank stepped within 240 s:\n{_read(err)[-3000:]}"
        start = time.monotonic()
        cut(cluster, "h3")
        try:
            ended = _poll(lambda: "hora-rc=" in _read(err), 60)
        finally:
            restore(cluster, "h3")
        if ended is not None:
            try:
                job.wait(timeout=120)  # the grid engine's own accounting: not what is measured, only bounded
            except subprocess.TimeoutExpired:
                pass
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    stderr = _read(err)
    assert ended is not None, f"hora run did not end within 60 s of the cut:\n{stderr[-3000:]}"
    elapsed, rc = ended - start, int(stderr.split("hora-rc=", 1)[1].split()[0])
    report = stderr[stderr.index("hora run: job failed"):] if "hora run: job failed" in stderr else stderr[-3000:]
    assert rc != 0, stderr[-3000:]
    assert re.search(r"root cause: rank \d on h3", report) and "lost: h3 stopped answering" in report, report
    assert elapsed <= 15, f"hora run ended {elapsed:.1f} s after the cut:\n{report}"
    print(f"sge: hora run ended {elapsed:.2f} s after the cut (rc {rc})")
