"""A job whose ranks never import torch: NumPy arrays through the core, on MPI, under `hora run`.

torch is made unimportable in the job (a package named torch that raises on import
comes first on PYTHONPATH), which is what a TensorFlow or MXNet user without torch has.
"""

from __future__ import annotations

import os
import sys

from tests.conftest import ROOT

BLOCK_TORCH = {"PYTHONPATH": f"{ROOT / 'tests' / 'scripts' / 'no_torch'}{os.pathsep}{ROOT}"}


def test_numpy_only_job_on_mpi(run_job):
    proc = run_job(2, [sys.executable, "tests/scripts/numpy_job.py"], mpi=True, timeout=120, env=BLOCK_TORCH)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for rank in range(2):
        assert f"[{rank}]<stdout>:numpy job ok" in proc.stdout, out[-4000:]
        assert f"[{rank}]<stdout>:rank {rank} raised:" in proc.stdout, out[-4000:]


def test_gloo_without_torch_names_the_fix(run_job):
    proc = run_job(2, [sys.executable, "tests/scripts/numpy_job.py"], timeout=120, env=BLOCK_TORCH)
    assert proc.returncode != 0
    assert "pip install 'hora[torch]'" in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
    assert "--mpi" in proc.stdout + proc.stderr
