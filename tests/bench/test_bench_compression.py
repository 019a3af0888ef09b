"""The cost model's view of compression: real models' gradient sets, bytes per allreduce, and the plan's row."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from hora.bench.compression import exchange, gradient_set
from hora.bench.model import CostModel
from hora.bench.plan import PlanConfig, predict
from hora.bench.train import TrainConfig
from hora.errors import ConfigError


def test_gradient_sets_are_the_real_models():
    resnet = gradient_set("resnet50")
    assert len(resnet) == 161 and sum(math.prod(s) for s in resnet) == 25_557_032
    vgg = gradient_set("vgg16")
    assert len(vgg) == 32 and sum(math.prod(s) for s in vgg) == 138_357_544
    with pytest.raises(ConfigError, match="resnet50"):
        gradient_set("alexnet")


def test_exchange_bytes_per_compressor():
    mlp = gradient_set("mlp")  # 1024x784, 1024, 1024x1024, 1024, 10x1024, 10
    full = sum(math.prod(s) for s in mlp) * 4
    assert exchange(mlp, "none").rounds == (full,)
    assert exchange(mlp, "bf16").rounds == (full / 2,)
    ps = exchange(mlp, "powersgd:2")
    # P: 1024*2 + 1024*2 + 10*2 rows, plus the two 1024-biases and the 10-bias uncompressed; Q: (784 + 1024 + 1024) * 2
    assert ps.rounds == ((1024 * 2 * 2 + 10 * 2 + 1024 * 2 + 10) * 4, (784 + 1024 + 1024) * 2 * 4)
    assert ps.ratio > 100 and ps.flops > 0
    with pytest.raises(ConfigError, match="compression"):
        exchange(mlp, "topk:3")


def test_plan_prices_the_compressed_ring():
    model = CostModel.from_strings("10gbit", "10us")
    result = predict(PlanConfig(workers=8, gradients="vgg16", compression="powersgd:4", compute_s=0.3), model)
    row = result["rows"][1]
    assert row["strategy"] == "ring allreduce, powersgd:4"
    assert row["vs_ring"] < 0.01 and row["efficiency"] > 0.99
    # two rounds of ring latency, and the arithmetic when a rate is given
    assert row["latency_s"] == pytest.approx(2 * 2 * 7 * 10e-6)
    slow = predict(PlanConfig(workers=8, gradients="vgg16", compression="powersgd:4", compress_flops=1e9), model)
    assert slow["compressed"]["time_s"] > result["compressed"]["time_s"] + 3.0  # 3.3 GFLOP at 1 GFLOP/s


def test_plan_cli_prints_the_compressed_row():
    out = subprocess.run([sys.executable, "-m", "hora.cli", "bench", "plan", "--workers", "64", "--link", "25gbit",
                          "--gradients", "resnet50", "--compression", "powersgd:4"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ring allreduce, powersgd:4" in out.stdout and "66.5x fewer bytes" in out.stdout


def test_train_refuses_compression_with_a_parameter_server():
    with pytest.raises(ConfigError, match="ps"):
        TrainConfig(strategies=["ps"], compression="fp16")
    with pytest.raises(ConfigError, match="compression"):
        TrainConfig(compression="zip")
    assert TrainConfig(compression="powersgd:2").worker_args("allreduce")[-2:] == ["--compression", "powersgd:2"]
