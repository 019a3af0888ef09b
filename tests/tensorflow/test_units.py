"""Single-process checks of the TF/Keras bindings' framework-free parts and refusals."""

from __future__ import annotations

import pytest

from hora.core.frontend import GradientReduction, gradient_reduction, resolve_op, warmup_multiplier
from hora.core.ops import ReduceOp
from hora.core.runtime import ProcessSet
from hora.errors import UnsupportedError


def test_warmup_goes_from_lr_over_size_to_lr():
    assert warmup_multiplier(0.0, 4, 5) == pytest.approx(0.25)
    assert warmup_multiplier(5.0, 4, 5) == pytest.approx(1.0)
    assert warmup_multiplier(2.5, 4, 5) == pytest.approx(0.625)
    assert warmup_multiplier(3.0, 1, 5) == pytest.approx(1.0)


def test_resolve_op():
    assert resolve_op(None, None) == ReduceOp.AVERAGE
    assert resolve_op(False, None) == ReduceOp.SUM
    assert resolve_op(None, ReduceOp.MAX) == ReduceOp.MAX
    with pytest.raises(ValueError, match="mutually exclusive"):
        resolve_op(True, ReduceOp.SUM)
    with pytest.raises(UnsupportedError, match="Adasum"):
        resolve_op(None, ReduceOp.ADASUM)


def test_gradient_reduction_checks_horovods_options_once():
    r = gradient_reduction(op=None, gradient_predivide_factor=4.0, num_groups=3)
    assert (r.op, r.prescale, r.postscale, r.groups) == (ReduceOp.AVERAGE, 0.25, 4.0, 3)
    assert gradient_reduction(groups=[["v"]], num_groups=3).groups == [["v"]]  # groups wins over num_groups
    with pytest.raises(ValueError, match="gradient_predivide_factor is only valid with op=hvd.Average"):
        gradient_reduction(op=ReduceOp.SUM, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="gradient_predivide_factor=0 must be > 0"):
        gradient_reduction(gradient_predivide_factor=0)
    with pytest.raises(UnsupportedError, match="Adasum"):
        gradient_reduction(op=ReduceOp.ADASUM)
    with pytest.raises(TypeError):
        GradientReduction(ReduceOp.SUM)  # keywords only: a positional mix-up cannot pass silently


def test_gradient_groups_are_the_present_gradients_in_order():
    grads = ["g0", None, "g2", "g3", "g4"]
    variables = ["v0", "v1", "v2", "v3", "v4"]
    assert GradientReduction().index_groups(grads, variables) == [[0, 2, 3, 4]]
    assert GradientReduction(groups=0).index_groups(grads, None) == [[0, 2, 3, 4]]
    assert GradientReduction(groups=2).index_groups(grads, None) == [[0, 2], [3, 4]]
    assert GradientReduction(groups=3).index_groups(grads, None) == [[0, 2], [3, 4]]
    assert GradientReduction(groups=9).index_groups(grads, None) == [[0], [2], [3], [4]]
    # lists of variables travel together, in the order given; the rest one by one; a None gradient is left out
    by_vars = GradientReduction(groups=[[variables[4], variables[0], variables[1]]])
    assert by_vars.index_groups(grads, variables) == [[4, 0], [2], [3]]
    assert GradientReduction().index_groups([None, None], None) == []
    with pytest.raises(ValueError, match="need the variables"):
        by_vars.index_groups(grads, None)


def test_a_single_rank_set_skips_the_reduction():
    assert GradientReduction(process_set=ProcessSet([0])).skips()
    # a set whose ranks are not known yet (the global set before init): not known to be one rank. A fresh
    # ProcessSet(None) stands for it, since another test of this process may have run init already.
    assert not GradientReduction(process_set=ProcessSet(None)).skips()


def test_keras_predivide_with_sum_is_refused():
    keras = pytest.importorskip("keras")
    import hora.keras as hvd

    with pytest.raises(ValueError, match="only valid with op=hvd.Average"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Sum, gradient_predivide_factor=2.0)


def test_keras_on_jax_is_refused_with_the_fix(monkeypatch):
    keras = pytest.importorskip("keras")
    import hora.keras as hvd

    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.raises(UnsupportedError, match="KERAS_BACKEND=tensorflow or KERAS_BACKEND=torch"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(UnsupportedError, match="jax.jit"):
        hvd.init()


def test_distributed_optimizer_keeps_class_name_config_and_isinstance():
    keras = pytest.importorskip("keras")
    import hora.keras as hvd

    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01, beta_1=0.8), name="mine")
    assert isinstance(opt, keras.optimizers.Adam) and type(opt).__name__ == "Adam"
    config = opt.get_config()
    assert config["beta_1"] == pytest.approx(0.8) and config["name"] == "mine"
    assert type(opt).from_config(config).get_config() == config
    # one subclass per optimizer class
    assert type(hvd.DistributedOptimizer(keras.optimizers.Adam())) is type(opt)


def test_tf_collective_error_is_both_kinds_and_picklable():
    pytest.importorskip("tensorflow")
    import pickle

    import tensorflow as tf

    from hora.errors import HoraError
    from hora.tensorflow.mpi_ops import CollectiveFailedError

    err = pickle.loads(pickle.dumps(CollectiveFailedError("allreduce named 'x': rank 0 shape (3,), rank 1 (4,)")))
    assert isinstance(err, tf.errors.FailedPreconditionError) and isinstance(err, HoraError)
    assert "named 'x'" in err.message


def test_tf_results_are_adopted_without_a_copy():
    pytest.importorskip("tensorflow")
    import numpy as np
    import tensorflow as tf

    from hora.tensorflow.mpi_ops import _adopt, _aligned_empty

    for dtype in (np.float32, np.float16, np.int64, np.uint8, np.bool_):
        a = _aligned_empty((3, 5), np.dtype(dtype))
        assert a.ctypes.data % 64 == 0 and a.shape == (3, 5) and a.dtype == dtype
        a[...] = 1
        t = _adopt(a)
        a[0, 0] = 0
        assert t.dtype == tf.as_dtype(dtype) and t.numpy()[0, 0] == 0  # the same memory: nothing was copied
    del a
    assert t.numpy().sum() == 14  # the tensor keeps the memory alive
    assert _adopt(_aligned_empty((0, 4), np.dtype(np.float32))).shape == (0, 4)
    scalar = _aligned_empty((), np.dtype(np.float64))
    scalar[()] = 3.0
    assert _adopt(scalar).numpy() == 3.0
