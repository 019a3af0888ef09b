"""The README's main job: the digits example trains to >= 0.95 on 2 processes."""

from __future__ import annotations

import re
import sys

import pytest


def test_train_digits_reaches_target_accuracy(run_job, tmp_path):
    proc = run_job(2, [sys.executable, "examples/torch/train_digits.py", "--min-accuracy", "0.95",
                       "--checkpoint-dir", str(tmp_path), "--no-progress"], timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    match = re.search(r"Test accuracy: ([0-9.]+)", proc.stdout)
    assert match and float(match.group(1)) >= 0.95
    assert re.search(r"Epoch\[0\] Batch \[0-\d+\]\s+Speed: [0-9.]+ samples/sec\s+accuracy=", proc.stdout)
    # logs and checkpoints come from rank 0 only
    assert "[1]<stdout>:Epoch[" not in proc.stdout
    assert any(tmp_path.iterdir()), "rank 0 wrote no checkpoint"


def test_synthetic_benchmark_reports_throughput(run_job):
    proc = run_job(2, [sys.executable, "examples/torch/synthetic_benchmark.py", "--model", "resnet18",
                       "--image-size", "32", "--batch-size", "4", "--num-warmup-batches", "1",
                       "--num-batches-per-iter", "1", "--num-iters", "2", "--num-classes", "10"], timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Number of CPUs: 2" in proc.stdout or "Number of GPUs: 2" in proc.stdout
    total = re.search(r"Total img/sec on 2 \w+\(s\): ([0-9.]+)", proc.stdout)
    assert total and float(total.group(1)) > 0


def test_parameter_server_example_reaches_the_same_accuracy(run_job, tmp_path):
    """The KVStore example: 2 workers and 2 servers (dist_sync) train as well as the allreduce example."""
    proc = run_job(2, [sys.executable, "examples/kvstore/train_digits_ps.py", "--kv-store", "dist_sync",
                       "--min-accuracy", "0.95", "--checkpoint-dir", str(tmp_path)],
                   extra_args=["-s", "2"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    match = re.search(r"Test accuracy: ([0-9.]+)", proc.stdout)
    assert match and float(match.group(1)) >= 0.95
    assert "KVStore dist_sync: 2 worker(s)" in proc.stdout
    assert "[server 1]" in proc.stdout + proc.stderr, "the launcher did not start 2 servers"
    assert any(tmp_path.iterdir()), "worker 0 wrote no checkpoint"


# ------------------------------------------------------------------ TensorFlow and Keras examples
TF_EXAMPLES = [
    pytest.param("examples/keras/train_digits.py", {"KERAS_BACKEND": "tensorflow"}, id="keras3-tf"),
    pytest.param("examples/keras/train_digits.py", {"KERAS_BACKEND": "torch"}, id="keras3-torch",
                 marks=pytest.mark.slow),
    pytest.param("examples/tensorflow/train_digits_tape.py", {}, id="tf-tape", marks=pytest.mark.slow),
    pytest.param("examples/tensorflow/train_digits_v1.py", {}, id="tf-v1", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("script", "env"), TF_EXAMPLES)
def test_tensorflow_and_keras_examples_reach_target_accuracy(run_job, tmp_path, script, env):
    pytest.importorskip("tensorflow")
    args = [sys.executable, script, "--min-accuracy", "0.95"]
    if script.endswith(("train_digits.py", "_v1.py")):
        args += ["--checkpoint-dir", str(tmp_path)]
    proc = run_job(2, args, mpi=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    match = re.search(r"\[0\]<stdout>:Test accuracy: ([0-9.]+)", proc.stdout)
    assert match and float(match.group(1)) >= 0.95, proc.stdout[-3000:]
    assert "[1]<stdout>:Test accuracy" not in proc.stdout, "only rank 0 reports"
    if "--checkpoint-dir" in args:
        assert any(tmp_path.iterdir()), "rank 0 wrote no checkpoint"
