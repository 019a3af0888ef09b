"""hora's server optimizers against MXNet 1.9.1's own, bit for bit, on random inputs (runs in .venv-mxnet).

Each case is run the way MXNet's server runs an optimizer (an updater, one
key at a time, the gradient in a reused buffer), with a scheduler, per-key
lr/wd multipliers and clipping; the hora side is built by the same converter
that ``kv.set_optimizer`` uses, from plain data.
"""

from __future__ import annotations

import logging
import warnings

import pytest

from tests.kvstore import mxnet_optimizer_cases as cases
from tests.mxnet.conftest import needs_mxnet

pytestmark = needs_mxnet


@pytest.fixture(autouse=True)
def _quiet():
    logging.disable(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    logging.disable(logging.NOTSET)


@pytest.mark.parametrize("case", cases.CASES, ids=[c["name"] for c in cases.CASES])
@pytest.mark.parametrize("seed", [0, 1])
def test_server_optimizer_matches_mxnet_bit_for_bit(case, seed):
    import hora.mxnet  # noqa: F401

    expected = cases.run_mxnet(case, seed)
    got = cases.run_hora(case, cases.hora_spec(case), seed)
    assert not cases.mismatches(expected, got)


def test_dcasgd_with_momentum_fails_in_mxnet_as_hora_refuses_it():
    import mxnet as mx

    from hora.errors import ConfigError
    from hora.mxnet.server_optimizer import hora_optimizer_of

    opt = mx.optimizer.DCASGD(momentum=0.9)
    updater = mx.optimizer.get_updater(opt)
    with pytest.raises((ValueError, AssertionError)):
        updater(0, mx.nd.ones((3,)), mx.nd.ones((3,)))
    with pytest.raises(ConfigError, match="momentum"):
        hora_optimizer_of(opt)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("kind", ["normal", "wide", "ties", "sparse"])
def test_sum_of_squares_is_mxnets_multi_sum_sq(kind, dtype):
    """LAMB's and LARS's norms: hora's vector walk against MXNet's own CPU kernel, on arrays long enough
    to cross many binades (and meet ties, zeros and a wide range of magnitudes)."""
    import mxnet as mx
    import numpy as np

    from hora.kvstore.optimizer.base import sum_sq

    rng = np.random.default_rng(11)
    n = 400_003
    x = {"normal": lambda: rng.standard_normal(n),
         "wide": lambda: rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3, n),
         "ties": lambda: rng.integers(-3, 4, n) / 2,
         "sparse": lambda: rng.standard_normal(n) * (rng.random(n) < 0.01)}[kind]().astype(dtype)
    want = mx.nd.multi_sum_sq(mx.nd.array(x, dtype=dtype), num_arrays=1).asnumpy()[0]
    assert sum_sq(x).tobytes() == np.float32(want).tobytes()


_LAZY = [("sgd_mom", "sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.01, "clip_gradient": 0.8}),
         ("sgd", "sgd", {"learning_rate": 0.1, "wd": 0.01, "rescale_grad": 0.5}),
         ("adam", "adam", {"learning_rate": 0.01, "wd": 0.01, "clip_gradient": 1.5}),
         ("adagrad", "adagrad", {"learning_rate": 0.1, "eps": 1e-6, "clip_gradient": 0.9, "rescale_grad": 0.7}),
         ("ftrl", "ftrl", {"learning_rate": 0.1, "lamda1": 0.02, "beta": 0.5, "wd": 0.01}),
         ("ftrl_clip", "ftrl", {"learning_rate": 0.05, "clip_gradient": 0.5})]


@pytest.mark.parametrize("name,opt,params", _LAZY, ids=[c[0] for c in _LAZY])
def test_row_sparse_updates_match_mxnets_lazy_kernels(name, opt, params):
    """The rows a server applies (hora.kvstore.ps.rows.apply_rows) against MXNet's own updater on a
    row_sparse weight and gradient, as MXNet's server holds them: only the pushed rows move, bit for bit,
    over steps with repeated, missing and no rows."""
    import mxnet as mx
    import numpy as np

    import hora.mxnet  # noqa: F401
    from hora.kvstore.optimizer import Updater
    from hora.kvstore.ps.rows import apply_rows, lazy_allowed, merge_rows
    from hora.mxnet.server_optimizer import hora_optimizer_of

    rng = np.random.default_rng(5)
    rows, width = 30, 5
    w0 = rng.standard_normal((rows, width)).astype(np.float32)
    mx_opt = mx.optimizer.create(opt, **params)
    mx_updater = mx.optimizer.get_updater(mx_opt)
    updater = Updater(hora_optimizer_of(mx.optimizer.create(opt, **params)))
    assert lazy_allowed(updater)
    weight = mx.nd.array(w0).tostype("row_sparse")
    value = w0.reshape(-1).copy()
    for step, ids in enumerate([[3, 7, 3, 20], [0, 29], [], [7, 8, 9, 10, 11, 12], [3, 7]]):
        ids = np.array(ids, np.int64)
        g = (rng.standard_normal((ids.size, width)) * 2).astype(np.float32)
        merged_ids, merged = merge_rows([(ids, g.reshape(-1))], width, np.float32)
        grad = mx.nd.sparse.row_sparse_array((merged, merged_ids), shape=(rows, width))
        mx_updater(0, grad, weight)
        apply_rows(updater, "0", merged_ids, merged, value, width)
        want = weight.asnumpy().reshape(-1)
        assert want.tobytes() == value.tobytes(), f"{name} step {step}: {int((want != value).sum())} differ"
    untouched = sorted(set(range(rows)) - {0, 3, 7, 8, 9, 10, 11, 12, 20, 29})
    np.testing.assert_array_equal(value.reshape(rows, width)[untouched], w0[untouched])


def test_row_sparse_adagrad_with_weight_decay_is_refused_as_mxnet_refuses_it():
    import mxnet as mx
    import numpy as np

    import hora.mxnet  # noqa: F401
    from hora.errors import ConfigError
    from hora.kvstore.optimizer import create_updater
    from hora.kvstore.ps.rows import apply_rows

    weight = mx.nd.ones((4, 2)).tostype("row_sparse")
    grad = mx.nd.sparse.row_sparse_array((np.ones((1, 2), np.float32), np.array([1])), shape=(4, 2))
    with pytest.raises(mx.base.MXNetError):  # its storage-type inference or its kernel refuses wd
        mx.optimizer.get_updater(mx.optimizer.create("adagrad", wd=0.1))(0, grad, weight)
        mx.nd.waitall()
    updater = create_updater({"type": "adagrad", "wd": 0.1})
    with pytest.raises(ConfigError, match="weight decay"):
        apply_rows(updater, "0", np.array([1]), np.ones(2, np.float32), np.ones(8, np.float32), 2)
