"""hora's server optimizers against MXNet 1.9.1's recorded results, bit for bit (no MXNet needed).

The results come from ``tests/kvstore/record_mxnet_optimizers.py`` run in
``.venv-mxnet``; ``tests/mxnet/test_mxnet_optimizers.py`` compares with MXNet
itself where it is installed.  Every one of MXNet's eighteen optimizers, with
schedulers, per-key lr/wd multipliers, clipping and float16 master copies.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hora.kvstore import optimizer as hopt
from hora.kvstore.optimizer import base
from tests.kvstore import mxnet_optimizer_cases as cases

RECORDED = Path(__file__).with_name("data") / "mxnet_optimizers.npz"


@pytest.fixture(scope="module")
def recorded():
    with np.load(RECORDED, allow_pickle=False) as data:
        return {name: data[name] for name in data.files}


def _check(case, recorded, **kwargs):
    name = case["name"]
    assert str(recorded[f"{name}/inputs"]) == cases.input_digest(case), (
        "this NumPy draws other random inputs than the recording's: re-record with record_mxnet_optimizers.py")
    spec = json.loads(str(recorded[f"{name}/spec"]))
    got = cases.flatten(cases.run_hora(case, spec, **kwargs))
    want = recorded[f"{name}/out"]
    assert got.dtype == want.dtype and got.shape == want.shape
    differ = np.flatnonzero(got.view(np.uint8).reshape(got.size, -1).any(axis=1)
                            != want.view(np.uint8).reshape(want.size, -1).any(axis=1))
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (
        f"{name}: {int((got != want).sum())} of {got.size} values differ from MXNet's ({differ[:5]} ...)")


@pytest.mark.parametrize("case", cases.CASES, ids=[c["name"] for c in cases.CASES])
def test_matches_mxnet_bit_for_bit(case, recorded):
    _check(case, recorded)


@pytest.mark.parametrize("case", [c for c in cases.CASES if c["opt"] in ("nadam", "lars", "lbsgd", "lamb", "adam")],
                         ids=lambda c: c["name"])
def test_saved_and_restored_state_goes_on_exactly(case, recorded):
    """State saved mid-run (msgpack, with the optimizer) and loaded into a fresh updater changes nothing."""
    _check(case, recorded, restore_after=2)


def test_every_mxnet_optimizer_is_registered():
    assert set(hopt.BUILTIN) == {
        "sgd", "signum", "ftml", "lars", "lbsgd", "lamb", "dcasgd", "nag", "sgld", "ccsgd", "adam", "adagrad",
        "rmsprop", "adadelta", "ftrl", "adamax", "nadam", "test"}


@pytest.mark.parametrize("name", ["sgd", "adam", "adagrad", "rmsprop", "nadam", "ftrl", "lamb", "nag", "signum"])
def test_blocks_and_threads_give_the_bits_of_one_pass(name, monkeypatch):
    """Large keys are updated in cache-sized blocks, runs of blocks on several threads: the bits are those of
    one pass over the whole array."""
    rng = np.random.default_rng(7)
    n = 3 * base.BLOCK + 17
    w0 = rng.standard_normal(n).astype(np.float32)
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(3)]

    def run():
        upd = hopt.Updater(hopt.create(name, wd=0.01, **({"momentum": 0.9} if name == "sgd" else {})))
        w = w0.copy()
        for g in grads:
            upd("k", g, w)
        return w

    monkeypatch.setattr(base, "PARALLEL_BLOCKS", 1)
    monkeypatch.setattr(base, "_THREADS", 3)
    threaded = run()
    monkeypatch.setattr(base, "BLOCK", 10 * n)
    np.testing.assert_array_equal(threaded, run())


def test_sgld_noise_has_the_right_distribution():
    """SGLD's deterministic step is MXNet's (above); its noise is N(0, sqrt(lr)) in distribution."""
    lr = 0.04
    upd = hopt.Updater(hopt.SGLD(learning_rate=lr))
    w = np.zeros(200_000, np.float32)
    upd("k", np.zeros_like(w), w)
    assert abs(float(w.mean())) < 5 * np.sqrt(lr) / np.sqrt(w.size)
    assert abs(float(w.std()) - np.sqrt(lr)) < 0.01 * np.sqrt(lr)
    assert w.dtype == np.float32


def test_dcasgd_with_momentum_is_refused_as_mxnet_fails():
    from hora.errors import ConfigError

    with pytest.raises(ConfigError, match="momentum"):
        hopt.DCASGD(momentum=0.9)
