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
