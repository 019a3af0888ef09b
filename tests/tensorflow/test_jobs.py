"""hora.tensorflow, hora.keras and hora.tensorflow.keras on 2 and 3 ranks, under MPI and gloo, through `hora run`.

Each case launches one job whose ranks run the rank-level tests in
tests/tensorflow/ranks for one flavour: TensorFlow ops (eager and
tf.function), Keras 3 on TensorFlow, Keras 3 on torch, or tf_keras.  MPI jobs
of TensorFlow and Keras-on-TensorFlow run with torch unimportable, proving
they need none.  TensorFlow takes seconds to import in every process, so the
default run takes one case per flavour; the rest of the matrix is marked slow.
"""

from __future__ import annotations

import os
import sys

import pytest

from tests.conftest import ROOT

pytest.importorskip("tensorflow")
pytest.importorskip("keras")

BLOCK_TORCH = f"{ROOT / 'tests' / 'scripts' / 'no_torch'}{os.pathsep}{ROOT}"

FLAVOURS = {
    "tf": {"HORA_TEST_KERAS": "tf"},
    "keras3-tf": {"HORA_TEST_KERAS": "keras3", "KERAS_BACKEND": "tensorflow"},
    "keras3-torch": {"HORA_TEST_KERAS": "keras3", "KERAS_BACKEND": "torch"},
    "tfkeras": {"HORA_TEST_KERAS": "tfkeras", "TF_USE_LEGACY_KERAS": "1"},
}
FAST = {("tf", 2, "mpi"), ("keras3-tf", 2, "mpi"), ("keras3-torch", 2, "gloo"), ("tfkeras", 2, "mpi")}
CASES = [pytest.param(f, n, c, marks=() if (f, n, c) in FAST else pytest.mark.slow, id=f"{f}-{c}-np{n}")
         for f in FLAVOURS for n in (2, 3) for c in ("mpi", "gloo")]


@pytest.mark.parametrize(("flavour", "np", "controller"), CASES)
def test_rank_level_suite(run_job, flavour, np, controller):
    env = dict(FLAVOURS[flavour])
    if controller == "mpi" and flavour != "keras3-torch":
        env["PYTHONPATH"] = BLOCK_TORCH
    if flavour == "keras3-torch":
        pytest.importorskip("torch")
    proc = run_job(np, [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        "tests/tensorflow/ranks"], mpi=controller == "mpi", timeout=600, env=env)
    tail = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, tail
    for rank in range(np):
        assert any(line.startswith(f"[{rank}]<stdout>:") and " passed" in line
                   for line in proc.stdout.splitlines()), f"rank {rank} did not report its tests passing:\n{tail}"


def test_threads_are_split_between_local_ranks_and_said_once(run_job):
    code = ("import logging, tensorflow as tf; logging.basicConfig(level=logging.INFO); "
            "import hora.tensorflow as hvd; hvd.init(); "
            "print('threads', tf.config.threading.get_intra_op_parallelism_threads(), "
            "tf.config.threading.get_inter_op_parallelism_threads())")
    proc = run_job(2, [sys.executable, "-c", code], mpi=True, timeout=300, env={"PYTHONPATH": BLOCK_TORCH})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    expected = max(1, len(os.sched_getaffinity(0)) // 2)
    for rank in range(2):
        assert f"[{rank}]<stdout>:threads {expected} {expected}" in proc.stdout, out[-3000:]
    assert out.count("TensorFlow gets") == 2, out[-3000:]  # once per rank
    proc = run_job(2, [sys.executable, "-c", code], mpi=True, timeout=300,
                   env={"PYTHONPATH": BLOCK_TORCH, "TF_NUM_INTRAOP_THREADS": "3"})
    assert proc.returncode == 0
    assert "TensorFlow gets" not in proc.stdout + proc.stderr, "a user's choice must be left alone"
