"""hora.mxnet on 2 and 3 ranks under MPI (and 2 workers + 2 servers for the PS-backed stores), through hora run."""

from __future__ import annotations

import re
import sys
import time

import pytest

from tests.conftest import hora_run
from tests.mxnet.conftest import needs_mxnet

pytestmark = needs_mxnet


def _ok(proc, marker: str, ranks: int) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    for rank in range(ranks):
        assert f"[{rank}]<stdout>:{marker}" in proc.stdout, out[-5000:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks", [2, 3])
def test_every_collective_with_its_dtypes_and_errors(ranks):
    proc = hora_run(ranks, [sys.executable, "tests/mxnet/scripts/ops_job.py"], mpi=True, timeout=240)
    _ok(proc, "mxnet ops ok", ranks)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks", [2, 3])
def test_training_matches_one_process(ranks):
    proc = hora_run(ranks, [sys.executable, "tests/mxnet/scripts/train_job.py"], mpi=True, timeout=240)
    _ok(proc, "mxnet training ok", ranks)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("store", ["hora_dist_sync", "hora_dist_async"])
def test_gluon_trainer_on_hora_parameter_servers(store):
    proc = hora_run(2, [sys.executable, "tests/mxnet/scripts/ps_train_job.py", "--kv-store", store], timeout=150,
                    extra_args=["-s", "2"])
    _ok(proc, f"ps training ok ({store}, sgd)", 2)


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("optimizer", ["adam", "lamb"])
def test_gluon_trainer_sends_other_optimizers_to_the_servers(optimizer):
    """gluon.Trainer(..., kvstore='hora_dist_sync') with each optimizer trains as one process does."""
    proc = hora_run(2, [sys.executable, "tests/mxnet/scripts/ps_train_job.py", "--kv-store", "hora_dist_sync",
                        "--optimizer", optimizer], timeout=150, extra_args=["-s", "2"])
    _ok(proc, f"ps training ok (hora_dist_sync, {optimizer})", 2)


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("store", ["hora_dist_sync", "hora_dist_async"])
def test_server_optimizers_match_mxnets_updater_bit_for_bit(store):
    """kv.set_optimizer with ten of MXNet's optimizers (a scheduler, multipliers, a key split over both servers):
    the pulled weights equal MXNet's own updater applied to what the servers received."""
    proc = hora_run(2, [sys.executable, "tests/mxnet/scripts/ps_optimizers_job.py", "--kv-store", store],
                    timeout=150, extra_args=["-s", "2"])
    _ok(proc, f"ps optimizers ok ({store})", 2)


@pytest.mark.timeout(150)
def test_a_tensor_only_one_rank_submits_stalls_on_every_rank():
    start = time.monotonic()
    proc = hora_run(2, [sys.executable, "tests/mxnet/scripts/stall_job.py"], mpi=True, timeout=120,
                    env={"HORA_STALL_CHECK_TIME_SECONDS": "1", "HORA_STALL_SHUTDOWN_TIME_SECONDS": "3"})
    assert time.monotonic() - start < 100
    for rank in range(2):
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(f"[{rank}]<stdout>:STALL")), None)
        assert line is not None, (proc.stdout + proc.stderr)[-4000:]
        assert float(re.search(r"after ([0-9.]+)s", line).group(1)) < 20, line


@pytest.mark.timeout(120)
def test_gloo_without_torch_names_the_fix():
    """MXNet's venv has no torch: asking for gloo fails on every rank with what to do instead."""
    proc = hora_run(2, [sys.executable, "tests/mxnet/scripts/ops_job.py"], mpi=False, timeout=90)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "BackendError" in out and "pip install 'hora[torch]'" in out and "--mpi" in out, out[-4000:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks", [2, 3])
def test_stateful_compression_in_distributed_trainer(ranks):
    proc = hora_run(ranks, [sys.executable, "tests/mxnet/scripts/compression_job.py"], mpi=True, timeout=240)
    _ok(proc, "mxnet compression ok", ranks)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(("framework", "spec"), [("mxnet", "powersgd:2"), ("mxnet", "fp16+ef"),
                                                  ("mxnet-optimizer", "powersgd:2")])
def test_trainer_checkpoint_with_compression_resumes_in_a_fresh_process(tmp_path, framework, spec):
    """``save_parameters`` + ``save_states`` after step 3, loaded by new processes: the same weights as without a
    stop (tests/scripts/compression_checkpoint.py, the script every binding's checkpoint test runs), with
    ``DistributedTrainer`` and with ``DistributedOptimizer`` under a plain ``gluon.Trainer``."""
    from tests.conftest import COMPRESSION_CHECKPOINT, checkpoint_resumes

    for mode in ("full", "resume"):
        proc = hora_run(2, [sys.executable, str(COMPRESSION_CHECKPOINT), "--framework", framework, "--mode", mode,
                            "--dir", str(tmp_path), "--compression", spec], mpi=True, timeout=180)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    checkpoint_resumes(tmp_path, 2)
