"""Stateful compression across processes: a checkpoint taken mid-training resumes identically in fresh processes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).parent / "scripts" / "compression_checkpoint.py"
CASES = [(2, "gloo", "powersgd:2"), (2, "mpi", "powersgd:2"), (3, "gloo", "fp16+ef"), (3, "mpi", "powersgd:1")]


@pytest.mark.parametrize(("np", "controller", "spec"), CASES, ids=[f"{c}-np{n}-{s}" for n, c, s in CASES])
def test_checkpoint_resumes_identically_in_a_fresh_process(run_job, tmp_path, np, controller, spec):
    for mode in ("full", "resume"):
        proc = run_job(np, [sys.executable, str(SCRIPT), "--mode", mode, "--dir", str(tmp_path), "--compression", spec],
                       mpi=controller == "mpi", timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(np):
        full = torch.load(tmp_path / f"full.{rank}.pt")
        resumed = torch.load(tmp_path / f"resume.{rank}.pt")
        for a, b in zip(full, resumed, strict=True):
            assert torch.equal(a, b), f"rank {rank}: the resumed run left the uninterrupted one"
        first = torch.load(tmp_path / "full.0.pt")
        assert all(torch.equal(a, b) for a, b in zip(full, first, strict=True)), f"rank {rank} differs from rank 0"
    # The checkpoint holds the compressor's state (so the test above depends on it).
    saved = torch.load(tmp_path / "ckpt.0.pt")["optimizer"]["hora_compression"]
    assert saved["step"] == 3 and saved["tensors"]
