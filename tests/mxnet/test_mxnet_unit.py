"""hora.mxnet pieces that need no other rank: compression, the KVStore registry, optimizer translation."""

from __future__ import annotations

import numpy as np
import pytest

from tests.mxnet.conftest import needs_mxnet

pytestmark = needs_mxnet


def test_fp16_compression_round_trips_floats_and_leaves_the_rest():
    import mxnet as mx

    import hora.mxnet as hvd

    for dtype in ("float16", "float32", "float64"):
        x = mx.nd.ones((3, 2), dtype=dtype) * 1.5
        sent, ctx = hvd.Compression.fp16.compress(x)
        assert sent.dtype == np.float16
        back = hvd.Compression.fp16.decompress(sent, ctx)
        assert back.dtype == x.dtype and (back.asnumpy() == 1.5).all()
    for dtype in ("uint8", "int8", "int32", "int64"):
        x = mx.nd.ones((3,), dtype=dtype)
        sent, ctx = hvd.Compression.fp16.compress(x)
        assert sent.dtype == x.dtype and hvd.Compression.fp16.decompress(sent, ctx).dtype == x.dtype


def test_stores_are_in_mxnets_registry():
    import mxnet as mx

    import hora.mxnet  # noqa: F401
    from hora.mxnet.kvstore import HoraAllreduceStore, HoraDistAsyncStore, HoraDistSyncStore

    registry = mx.kvstore.KVStoreBase.kv_registry
    assert registry["hora"] is HoraAllreduceStore
    assert registry["hora_dist_sync"] is HoraDistSyncStore
    assert registry["hora_dist_async"] is HoraDistAsyncStore
    assert not HoraAllreduceStore.is_capable("optimizer") and HoraDistSyncStore.is_capable("optimizer")


def test_mxnet_optimizers_become_server_optimizers():
    import mxnet as mx

    from hora.errors import ConfigError
    from hora.kvstore import optimizer as hopt
    from hora.mxnet.kvstore import hora_optimizer_of

    sgd = hora_optimizer_of(mx.optimizer.SGD(learning_rate=0.3, momentum=0.9, wd=1e-4, rescale_grad=0.125))
    assert isinstance(sgd, hopt.SGD)
    assert (sgd.lr, sgd.momentum, sgd.wd, sgd.rescale_grad) == (0.3, 0.9, 1e-4, 0.125)
    adam = hora_optimizer_of(mx.optimizer.Adam(learning_rate=0.01, beta1=0.8))
    assert isinstance(adam, hopt.Adam) and adam.beta1 == 0.8
    adagrad = hora_optimizer_of(mx.optimizer.AdaGrad(eps=1e-5))
    assert isinstance(adagrad, hopt.AdaGrad) and adagrad.eps == 1e-5
    sched = hora_optimizer_of(mx.optimizer.SGD(lr_scheduler=mx.lr_scheduler.FactorScheduler(step=10, factor=0.5)))
    assert sched.lr_scheduler.spec()["step"] == 10 and sched.lr_scheduler.factor == 0.5
    with pytest.raises(ConfigError, match="MXNet 1.9.1's DCASGD fails"):
        hora_optimizer_of(mx.optimizer.DCASGD(momentum=0.9))

    class MySGD(mx.optimizer.SGD):
        pass

    with pytest.raises(ConfigError, match="update_on_kvstore=False.*HORA_PS_OPTIMIZER_MODULES"):
        hora_optimizer_of(MySGD())

    class CustomScheduler(mx.lr_scheduler.LRScheduler):
        def __call__(self, num_update):
            return 0.1

    with pytest.raises(ConfigError, match="cannot travel"):
        hora_optimizer_of(mx.optimizer.SGD(lr_scheduler=CustomScheduler()))


def test_split_list_cuts_into_nearly_equal_consecutive_parts():
    from hora.mxnet.optimizer import split_list

    assert split_list(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_list([1, 2], 5) == [[1], [2]]


def test_collectives_refuse_what_they_cannot_take():
    import mxnet as mx

    from hora.mxnet.buffers import check_ndarray

    with pytest.raises(TypeError, match="mx.nd.NDArray"):
        check_ndarray(np.ones(2), "allreduce")
    with pytest.raises(TypeError, match="tostype"):
        check_ndarray(mx.nd.ones((2, 2)).tostype("csr"), "allreduce")


def test_host_views_share_memory_with_the_ndarray():
    import mxnet as mx

    from hora.mxnet.buffers import read_view, to_ndarray, write_view

    x = mx.nd.arange(6).reshape((2, 3)) * 2  # still being computed by MXNet's engine
    view = write_view(x)
    view[0, 0] = 42
    assert x.asnumpy()[0, 0] == 42 and read_view(x)[1, 2] == 10
    back = to_ndarray(np.arange(4, dtype=np.int64))
    assert isinstance(back, mx.nd.NDArray) and back.dtype == np.int64 and back.asnumpy().tolist() == [0, 1, 2, 3]


def test_engine_operations_hold_back_later_operators_until_they_complete():
    import threading
    import time

    import mxnet as mx

    from hora.mxnet import engine
    from hora.mxnet.buffers import engine_view

    if not engine.available():
        pytest.skip("MXNET_ENGINE_TYPE=NaiveEngine completes every operation inside its push")
    src = mx.nd.arange(4) * 3  # still being computed: the operation must wait for it
    dst = mx.nd.zeros((4,))
    seen: list[str] = []

    def start(done: engine.Completion) -> None:  # on an engine thread, src written, dst free
        values = engine_view(src).copy()

        def later() -> None:
            time.sleep(0.2)
            engine_view(dst)[:] = values + 1
            seen.append("completed")
            done()
            done()  # a second call does nothing

        threading.Thread(target=later).start()

    engine.push_async(start, reads=[src], writes=[dst], name="test_async")
    after = dst * 2  # MXNet holds this back until the operation completes
    assert after.asnumpy().tolist() == [2.0, 8.0, 14.0, 20.0] and seen == ["completed"]

    engine.push_sync(lambda: seen.append("sync"), reads=[dst], writes=[src], name="test_sync")
    src.wait_to_read()
    assert seen == ["completed", "sync"]
    with pytest.raises(ValueError, match="twice"):
        engine.push_sync(lambda: None, reads=[], writes=[dst, dst])
    mx.nd.waitall()


def test_an_mxnet_optimizer_of_ones_own_travels_once_registered_on_the_servers(monkeypatch):
    """An mx.optimizer subclass whose name a module in HORA_PS_OPTIMIZER_MODULES registers is sent as data."""
    import sys

    import mxnet as mx

    from hora.kvstore.optimizer import registry
    from hora.mxnet.server_optimizer import hora_optimizer_of

    monkeypatch.setattr(registry, "OPTIMIZERS", dict(registry.OPTIMIZERS))
    monkeypatch.setattr(registry, "_loaded", set())
    monkeypatch.delitem(sys.modules, "tests.kvstore.custom_optimizer", raising=False)
    monkeypatch.setenv("HORA_PS_OPTIMIZER_MODULES", "tests.kvstore.custom_optimizer")

    class HalfStep(mx.optimizer.Optimizer):
        def __init__(self, scale=0.5, **kwargs):
            super().__init__(**kwargs)
            self.scale = scale

    spec = hora_optimizer_of(HalfStep(scale=0.25, learning_rate=0.2)).spec()
    assert spec["type"] == "halfstep" and spec["scale"] == 0.25 and spec["learning_rate"] == 0.2
