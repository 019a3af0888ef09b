"""Under Slurm, a node whose link is cut (no FIN, no RST) ends an srun job within 15 s, and the report names it.

``hora run`` runs inside ``salloc -N 3 -n 3``: srun starts one rank a node,
and the slurm launcher watches the other nodes with beat-only agents it
reaches through ``srun --overlap``.  h3's veth leaves the bridge
(:func:`hora.testing.partition.cut`); the job must end within 15 s of the
cut, non-zero, with a root cause naming h3.  Every wait is bounded.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from hora.testing.partition import cut, restore
from tests.cluster.test_cluster_host_loss import LOOP, wait_for_steps
from tests.cluster.test_cluster_slurm import REPO, slurm  # noqa: F401 - the module's Slurm cluster

pytestmark = [pytest.mark.netns, pytest.mark.slow]


@pytest.mark.timeout(400)
def test_a_node_cut_off_ends_the_srun_job_within_15_s_naming_it(cluster, slurm):  # noqa: F811
    env = {k: v for k, v in slurm.items() if not k.startswith(("HORA_", "OMPI_", "PMIX_", "SLURM_JOB"))}
    env["PYTHONPATH"] = str(REPO)
    env.pop("OMP_NUM_THREADS", None)
    # The shell says when hora run itself ended, whatever salloc does with the lost node afterwards.
    script = f"{sys.executable} -m hora.runner.cli run -np 3 {sys.executable} {LOOP}; echo hora-rc=$? >&2"
    job = cluster.popen("h1", ["salloc", "-N", "3", "-n", "3", "sh", "-c", script], env=env, cwd=str(REPO),
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), x) for x in job.stderr), daemon=True)
    reader.start()
    try:
        wait_for_steps(job, 3, 240)
        threading.Thread(target=lambda: [None for _ in job.stdout], daemon=True).start()  # type: ignore[union-attr]
        start = time.monotonic()
        cut(cluster, "h3")
        try:
            deadline = time.monotonic() + 60
            while not any("hora-rc=" in x for _, x in lines) and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            restore(cluster, "h3")
        if any("hora-rc=" in x for _, x in lines):
            job.wait(timeout=60)  # salloc gives the allocation back
            reader.join(10)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    stderr = "".join(x for _, x in lines)
    ended = [(t, x) for t, x in lines if "hora-rc=" in x]
    assert ended, f"hora run did not end within 60 s of the cut:\n{stderr[-3000:]}"
    elapsed, rc = ended[0][0] - start, int(ended[0][1].split("hora-rc=", 1)[1])
    report = stderr[stderr.index("hora run: job failed"):] if "hora run: job failed" in stderr else stderr[-3000:]
    assert rc != 0, stderr[-3000:]
    assert "root cause: rank 2 on h3" in report and "lost: h3 stopped answering" in report, report
    assert elapsed <= 15, f"hora run ended {elapsed:.1f} s after the cut:\n{report}"
    print(f"slurm: hora run ended {elapsed:.2f} s after the cut (rc {rc})")
