"""hora.tensorflow's collectives on every rank: values, dtypes, gradients and errors, eagerly and in tf.function."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import hora.tensorflow as hvd

MODES = ["eager", "function"]
#: and as a TF1 graph run by a session, as Horovod's tests run every op
ALL_MODES = [*MODES, "graph"]
FLOATS = [tf.float16, tf.float32, tf.float64]
INTS = [tf.uint8, tf.int8, tf.int32, tf.int64]


def run(mode, fn, *args):
    """``fn(*args)`` eagerly, traced into a tf.function, or built into a TF1 graph that a session runs."""
    if mode == "eager":
        return fn(*args)
    if mode == "function":
        return tf.function(fn)(*args)
    with tf.Graph().as_default():
        out = fn(*[tf.constant(a.numpy()) for a in args])
        with tf.compat.v1.Session() as sess:
            values = sess.run(out)
    return tf.nest.map_structure(tf.constant, values)


def rank_values(shape, dtype, offset=0):
    base = np.arange(int(np.prod(shape))).reshape(shape) % 5
    return tf.constant(base + hvd.rank() + offset, dtype=dtype)


def expected_sum(shape):
    n = hvd.size()
    return (np.arange(int(np.prod(shape))).reshape(shape) % 5) * n + sum(range(n))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", FLOATS + INTS)
def test_allreduce_sum_dtypes(mode, dtype):
    t = rank_values((3, 4), dtype)
    out = run(mode, lambda x: hvd.allreduce(x, op=hvd.Sum), t)
    assert out.dtype == dtype and out.shape == (3, 4)
    np.testing.assert_allclose(out.numpy().astype(np.float64), expected_sum((3, 4)))


@pytest.mark.parametrize("mode", MODES)
def test_allreduce_and_broadcast_results_of_every_shape_outlive_their_inputs(mode):
    """Results are written into arrays that become the tensors (bfloat16, empty and 0-d too)."""
    import gc

    n = hvd.size()
    cases = [rank_values((3, 4), tf.bfloat16), tf.zeros([0, 3]), tf.constant(float(hvd.rank())),
             rank_values((1000,), tf.float32)]
    outs = [run(mode, lambda x: (hvd.allreduce(x, op=hvd.Sum), hvd.broadcast(x, n - 1)), c) for c in cases]
    del cases
    gc.collect()
    junk = [hvd.allreduce(tf.ones([1000]) * i) for i in range(5)]  # new allocations where freed memory was
    (b16, b16_root), (empty, _), (scalar, scalar_root), (big, big_root) = outs
    assert b16.dtype == tf.bfloat16
    np.testing.assert_allclose(b16.numpy().astype(np.float64), expected_sum((3, 4)))
    np.testing.assert_allclose(b16_root.numpy().astype(np.float64), (np.arange(12).reshape(3, 4) % 5) + n - 1)
    assert empty.shape == (0, 3)
    assert scalar.shape == () and scalar.numpy() == sum(range(n)) and scalar_root.numpy() == n - 1
    np.testing.assert_allclose(big.numpy(), expected_sum((1000,)))
    np.testing.assert_allclose(big_root.numpy(), np.arange(1000) % 5 + n - 1)
    assert len(junk) == 5


@pytest.mark.parametrize("mode", ALL_MODES)
def test_allreduce_average_min_max_product_and_scales(mode):
    r, n = hvd.rank(), hvd.size()
    t = tf.constant([r + 1.0, -r, 2.0], tf.float64)

    def f(x):
        return (hvd.allreduce(x), hvd.allreduce(x, op=hvd.Min), hvd.allreduce(x, op=hvd.Max),
                hvd.allreduce(x, op=hvd.Product), hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0,
                                                                postscale_factor=0.5))

    avg, mn, mx, prod, scaled = run(mode, f, t)
    np.testing.assert_allclose(avg.numpy(), [(n + 1) / 2, -(n - 1) / 2, 2.0])
    np.testing.assert_allclose(mn.numpy(), [1.0, -(n - 1), 2.0])
    np.testing.assert_allclose(mx.numpy(), [n, 0.0, 2.0])
    np.testing.assert_allclose(prod.numpy()[0], float(np.prod(np.arange(1, n + 1))))
    np.testing.assert_allclose(scaled.numpy(), [n * (n + 1) / 2, -n * (n - 1) / 2, 2.0 * n])


@pytest.mark.parametrize("mode", ALL_MODES)
def test_grouped_allreduce_and_fp16_compression(mode):
    a, b = rank_values((5,), tf.float32), rank_values((2, 3), tf.float64, offset=1)

    def f(x, y):
        return hvd.grouped_allreduce([x, y], op=hvd.Sum), hvd.allreduce(x, op=hvd.Sum,
                                                                        compression=hvd.Compression.fp16)

    (ra, rb), rc = run(mode, f, a, b)
    np.testing.assert_allclose(ra.numpy(), expected_sum((5,)))
    np.testing.assert_allclose(rb.numpy(), expected_sum((2, 3)) + hvd.size())
    assert rc.dtype == tf.float32
    np.testing.assert_allclose(rc.numpy(), expected_sum((5,)))


@pytest.mark.parametrize("mode", ALL_MODES)
def test_allgather_variable_rows_and_grouped(mode):
    r, n = hvd.rank(), hvd.size()
    t = tf.fill([r + 1, 2], float(r))
    u = tf.constant([r], tf.int64)

    def f(x, y):
        return hvd.allgather(x), hvd.grouped_allgather([x, y])

    out, (g1, g2) = run(mode, f, t, u)
    expected = np.concatenate([np.full((i + 1, 2), float(i)) for i in range(n)])
    np.testing.assert_array_equal(out.numpy(), expected)
    np.testing.assert_array_equal(g1.numpy(), expected)
    assert g2.numpy().tolist() == list(range(n))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [tf.float32, tf.int32, tf.bool])
def test_broadcast_from_every_root(mode, dtype):
    for root in range(hvd.size()):
        t = tf.cast(tf.fill([3, 2], hvd.rank() % 2 if dtype == tf.bool else hvd.rank()), dtype)
        out = run(mode, lambda x, root=root: hvd.broadcast(x, root), t)
        assert out.dtype == dtype
        np.testing.assert_array_equal(out.numpy(), np.full((3, 2), root % 2 if dtype == tf.bool else root))


def test_broadcast_inplace_and_variables():
    v = tf.Variable(tf.fill([4], float(hvd.rank())))
    w = tf.Variable(tf.fill([2, 2], hvd.rank() + 10))
    (out,) = hvd.broadcast_([v], root_rank=hvd.size() - 1)
    np.testing.assert_array_equal(v.numpy(), np.full(4, hvd.size() - 1.0))
    np.testing.assert_array_equal(out.numpy(), v.numpy())
    scalar = tf.Variable(hvd.rank() + 7, dtype=tf.int64)  # scalars too (an optimizer's iteration count)
    hvd.broadcast_variables([v, w, scalar], root_rank=0)
    assert scalar.numpy() == 7
    np.testing.assert_array_equal(w.numpy(), np.full((2, 2), 10))
    np.testing.assert_array_equal(v.numpy(), np.full(4, hvd.size() - 1.0))  # already the last rank's


def test_broadcast_variables_of_a_keras_model_inside_tf_function():
    """Horovod's TF2 examples broadcast ``model.variables`` inside their tf.function step; with TF >= 2.16
    ``tf.keras`` is Keras 3, whose variables are not tf.Variables."""
    tf.keras.utils.set_random_seed(300 + hvd.rank())
    model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(2)])
    root = hvd.broadcast_object([np.array(w) for w in model.get_weights()], root_rank=0)

    @tf.function
    def step():
        hvd.broadcast_variables(model.variables, root_rank=0)
        return model(tf.ones((1, 3)))

    out = step()
    for got, want in zip(model.get_weights(), root, strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(out.numpy(), np.ones((1, 3)) @ root[0] + root[1], rtol=1e-6)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_alltoall_uneven_splits(mode):
    r, n = hvd.rank(), hvd.size()
    # rank r sends (i + 1) rows valued r to rank i
    splits = tf.constant([i + 1 for i in range(n)], tf.int32)
    rows = sum(range(1, n + 1))
    t = tf.fill([rows, 3], float(r))
    out, received = run(mode, lambda x, s: hvd.alltoall(x, splits=s), t, splits)
    assert received.numpy().tolist() == [r + 1] * n
    expected = np.concatenate([np.full((r + 1, 3), float(i)) for i in range(n)])
    np.testing.assert_array_equal(out.numpy(), expected)
    even = run(mode, lambda x: hvd.alltoall(x), tf.fill([2 * n], float(r)))
    np.testing.assert_array_equal(even.numpy(), np.repeat(np.arange(n, dtype=np.float32), 2))


@pytest.mark.parametrize("mode", ALL_MODES)
def test_reducescatter_sum_average(mode):
    r, n = hvd.rank(), hvd.size()
    t = tf.constant(np.arange(2 * n * 3).reshape(2 * n, 3) + r, tf.float32)

    def f(x):
        return hvd.reducescatter(x, op=hvd.Sum), hvd.reducescatter(x)

    s, a = run(mode, f, t)
    full = np.arange(2 * n * 3).reshape(2 * n, 3) * n + sum(range(n))
    np.testing.assert_allclose(s.numpy(), full[2 * r: 2 * r + 2])
    np.testing.assert_allclose(a.numpy(), full[2 * r: 2 * r + 2] / n)


def _gradient(mode, op_fn, x):
    def f(v):
        with tf.GradientTape() as tape:
            tape.watch(v)
            loss = tf.reduce_sum(op_fn(v))
        return tape.gradient(loss, v)

    return run(mode, f, x).numpy()


@pytest.mark.parametrize("mode", MODES)
def test_gradients_as_horovod_defines_them(mode):
    r, n = hvd.rank(), hvd.size()
    x = tf.constant([1.0, 2.0, 3.0 * (r + 1)])
    # allreduce(Sum): d/dx sum(allreduce(x)) = allreduce(ones) = n
    np.testing.assert_allclose(_gradient(mode, lambda v: hvd.allreduce(v, op=hvd.Sum), x), [n] * 3)
    # allreduce(Average) of ones averaged again: 1
    np.testing.assert_allclose(_gradient(mode, lambda v: hvd.allreduce(v), x), [1.0] * 3)
    # allgather: this rank's rows of the averaged upstream gradient (ones)
    rows = tf.fill([r + 1, 2], 1.0)
    np.testing.assert_allclose(_gradient(mode, lambda v: hvd.allgather(v), rows), np.ones((r + 1, 2)))
    # broadcast: the averaged gradient goes to the root only
    expected = np.ones(3) if r == 0 else np.zeros(3)
    np.testing.assert_allclose(_gradient(mode, lambda v: hvd.broadcast(v, 0), x), expected)
    # alltoall: the reverse alltoall of ones
    np.testing.assert_allclose(_gradient(mode, lambda v: hvd.alltoall(v), tf.ones([2 * n])), np.ones(2 * n))
    # reducescatter(Sum): allgather of the upstream times n
    np.testing.assert_allclose(_gradient(mode, lambda v: hvd.reducescatter(v, op=hvd.Sum), tf.ones([n, 2])),
                               np.full((n, 2), float(n)))


@pytest.mark.parametrize("mode", MODES)
def test_distributed_gradient_tape_averages(mode):
    r, n = hvd.rank(), hvd.size()
    w = tf.Variable([1.0, 1.0])
    local = tf.Variable([2.0])

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * float(r + 1)) + tf.reduce_sum(local * float(r + 1))
        tape = hvd.DistributedGradientTape(tape)
        tape.register_local_source(local)
        return tape.gradient(loss, [w, local])

    gw, gl = run(mode, step)
    np.testing.assert_allclose(gw.numpy(), [(n + 1) / 2] * 2)
    np.testing.assert_allclose(gl.numpy(), [(r + 1) / n])  # local, scaled by 1/size as in Horovod


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ALL_MODES)
def test_mismatched_shapes_fail_on_every_rank_naming_the_tensor(mode):
    if hvd.size() == 1:
        pytest.skip("needs two ranks")
    t = tf.ones([3 + hvd.rank()])
    with pytest.raises(tf.errors.FailedPreconditionError, match="mismatch_shape"):
        run(mode, lambda x: hvd.allreduce(x, name="mismatch_shape"), t)
    t = tf.ones([3], dtype=tf.int32 if hvd.rank() == 0 else tf.float32)
    with pytest.raises(tf.errors.FailedPreconditionError, match="mismatch_dtype"):
        run(mode, lambda x: hvd.allreduce(x, name="mismatch_dtype"), t)
    with pytest.raises(tf.errors.FailedPreconditionError, match="mismatch_root"):
        run(mode, lambda x: hvd.broadcast(x, hvd.rank(), name="mismatch_root"), tf.ones([2]))
    # the engine is still healthy afterwards
    np.testing.assert_allclose(hvd.allreduce(tf.ones([2]), op=hvd.Sum).numpy(), [hvd.size()] * 2)


def test_errors_are_hora_errors_too():
    from hora.errors import HoraError

    assert issubclass(hvd.CollectiveFailedError, HoraError)
    assert issubclass(hvd.CollectiveFailedError, tf.errors.FailedPreconditionError)


def test_process_set_collectives():
    n = hvd.size()
    ps = hvd.add_process_set([0, n - 1] if n > 2 else [n - 1])  # [0, 1] would be the global set
    try:
        if ps.included():
            out = hvd.allreduce(tf.constant([float(hvd.rank())]), op=hvd.Sum, process_set=ps)
            assert out.numpy().tolist() == [float(sum(ps.ranks))]
            assert hvd.size_op(ps.process_set_id).numpy() == len(ps.ranks)
        assert hvd.process_set_included_op(ps.process_set_id).numpy() == int(ps.included())
    finally:
        hvd.remove_process_set(ps)


def test_topology_ops_and_objects():
    assert hvd.rank_op().numpy() == hvd.rank() and hvd.size_op().numpy() == hvd.size()
    assert hvd.local_rank_op().numpy() == hvd.local_rank() and hvd.local_size_op().numpy() == hvd.local_size()
    obj = hvd.broadcast_object({"from": hvd.rank(), "fn": len} if hvd.rank() == 0 else None, root_rank=0)
    assert obj["from"] == 0 and obj["fn"] is len
    assert hvd.allgather_object(("r", hvd.rank())) == [("r", i) for i in range(hvd.size())]
    assert hvd.broadcast_object_fn(root_rank=hvd.size() - 1)(hvd.rank()) == hvd.size() - 1


@pytest.mark.timeout(120)
def test_join_serves_the_others_allreduces():
    r, n = hvd.rank(), hvd.size()
    if r == 0:
        out = hvd.allreduce(tf.constant([5.0]), op=hvd.Sum, name="before_join")
        assert out.numpy().tolist() == [5.0]  # the joined ranks contributed zeros
    last = hvd.join()
    assert int(last) in range(n)


def test_tf1_graph_optimizer_and_broadcast_hook():
    """A tf.compat.v1 graph: DistributedOptimizer.compute_gradients averages, the hook broadcasts at start."""
    r, n = hvd.rank(), hvd.size()
    with tf.Graph().as_default():
        w = tf.compat.v1.get_variable("w", initializer=tf.constant([float(r), 1.0]), use_resource=True)
        loss = tf.reduce_sum(w * float(r + 1))
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.5))
        grads = opt.compute_gradients(loss, var_list=[w])
        train = opt.apply_gradients(grads)
        hook = hvd.BroadcastGlobalVariablesHook(0)
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=[hook]) as sess:
            assert sess.run(w).tolist() == [0.0, 1.0]  # root's value everywhere
            g = sess.run(grads[0][0])
            np.testing.assert_allclose(g, [(n + 1) / 2] * 2)
            sess.run(train)
            np.testing.assert_allclose(sess.run(w), [-(n + 1) / 4, 1.0 - (n + 1) / 4])
    with pytest.raises(RuntimeError, match="eager"):
        hvd.broadcast_global_variables(0)


def test_sync_batch_norm_uses_every_ranks_batch():
    r, n = hvd.rank(), hvd.size()
    full = np.arange(4 * n * 2, dtype=np.float32).reshape(4 * n, 2)
    mine = full[4 * r: 4 * r + 4]
    layer = hvd.SyncBatchNormalization(momentum=0.0)
    out = layer(tf.constant(mine), training=True).numpy()
    mean, var = full.mean(0), full.var(0)
    np.testing.assert_allclose(out, (mine - mean) / np.sqrt(var + layer.epsilon), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(layer.moving_mean.numpy(), mean, rtol=1e-5)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_uint16_travels_through_ops_without_arithmetic(mode):
    r, n = hvd.rank(), hvd.size()
    t = tf.constant([60000 + r, r], tf.uint16)
    rows = tf.constant([60000 + r, r] * n, tf.uint16)  # chunk i goes to rank i

    def f(x, y):
        return hvd.allgather(x), hvd.broadcast(x, n - 1), hvd.alltoall(y)

    gathered, bcast, a2a = run(mode, f, t, rows)
    assert gathered.dtype == tf.uint16 and bcast.dtype == tf.uint16 and a2a.dtype == tf.uint16
    assert gathered.numpy().tolist() == [v for i in range(n) for v in (60000 + i, i)]
    assert bcast.numpy().tolist() == [60000 + n - 1, n - 1]
    assert a2a.numpy().tolist() == [v for i in range(n) for v in (60000 + i, i)]


@pytest.mark.timeout(180, method="thread")  # a deadlock blocks inside session.run, where a signal cannot reach
def test_tf1_session_runs_independent_collectives_in_any_order():
    """One session.run fetching many independent collectives on one inter-op thread, built in a different
    order on every rank: a collective waiting for the other ranks must not hold the session's only thread."""
    r, n = hvd.rank(), hvd.size()
    kinds = ["allreduce", "allgather", "broadcast", "alltoall", "reducescatter"] * 2
    order = list(range(len(kinds)))
    if r % 2:
        order.reverse()
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1, intra_op_parallelism_threads=1,
                                      use_per_session_threads=True)
    with tf.Graph().as_default():
        fetches = {}
        for i in order:
            x = tf.constant(np.full([2 * n], float(i + r), np.float32))
            name = f"tf1_order_{i}"
            fetches[i] = {
                "allreduce": lambda x=x, name=name: hvd.allreduce(x, op=hvd.Sum, name=name),
                "allgather": lambda x=x, name=name: hvd.allgather(x, name=name),
                "broadcast": lambda x=x, name=name: hvd.broadcast(x, 0, name=name),
                "alltoall": lambda x=x, name=name: hvd.alltoall(x, name=name),
                "reducescatter": lambda x=x, name=name: hvd.reducescatter(x, op=hvd.Sum, name=name),
            }[kinds[i]]()
        with tf.compat.v1.Session(config=config) as sess:
            for _ in range(3):
                values = sess.run([fetches[i] for i in range(len(kinds))])
    ranks = np.arange(n, dtype=np.float32)
    for i, (kind, got) in enumerate(zip(kinds, values, strict=True)):
        expected = {"allreduce": np.full(2 * n, n * i + ranks.sum()),
                    "allgather": np.repeat(i + ranks, 2 * n),
                    "broadcast": np.full(2 * n, float(i)),
                    "alltoall": np.repeat(i + ranks, 2),
                    "reducescatter": np.full(2, n * i + ranks.sum())}[kind]
        np.testing.assert_allclose(got, expected, err_msg=f"{kind} #{i}")


@pytest.mark.parametrize("mode", ALL_MODES)
def test_alltoall_bad_splits_are_invalid_argument(mode):
    """As in Horovod: rows that do not split evenly, or splits beyond the rows, are InvalidArgumentError."""
    n = hvd.size()
    if n == 1:
        pytest.skip("every length splits evenly over one rank")
    with pytest.raises(tf.errors.InvalidArgumentError, match="divide evenly"):
        run(mode, lambda x: hvd.alltoall(x), tf.ones([n + 1]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="sum to at most"):
        run(mode, lambda x, s: hvd.alltoall(x, splits=s)[0], tf.ones([n - 1]), tf.ones([n], tf.int32))
    with pytest.raises(ValueError):  # still a ValueError too
        hvd.alltoall(tf.ones([n + 1]))
    # the engine is still healthy afterwards
    np.testing.assert_allclose(hvd.alltoall(tf.ones([n])).numpy(), np.ones(n))


def test_tensorflow_state_commit_restore_sync():
    r = hvd.rank()
    v = tf.Variable(np.full((2, 2), r + 1.0))
    w = tf.Variable(np.full(3, 10.0 * (r + 1), np.float32))
    state = hvd.elastic.TensorFlowState([v, w], batch=20 + r, epoch=10 + r)
    state.sync()  # rank 0's values and attributes everywhere
    np.testing.assert_array_equal(v.numpy(), np.ones((2, 2)))
    np.testing.assert_array_equal(w.numpy(), np.full(3, 10.0))
    assert (state.batch, state.epoch) == (20, 10)
    v.assign(np.full((2, 2), 5.0))
    state.batch = 21
    state.restore()  # back to the sync (the last commit point)
    np.testing.assert_array_equal(v.numpy(), np.ones((2, 2)))
    assert state.batch == 20
    v.assign(np.full((2, 2), 7.0))
    state.epoch = 11
    state.commit()
    v.assign(np.zeros((2, 2)))
    state.restore()
    np.testing.assert_array_equal(v.numpy(), np.full((2, 2), 7.0))
    assert state.epoch == 11
    with pytest.raises(ValueError, match="needs the variables"):
        hvd.elastic.TensorFlowState()


def test_tensorflow_state_in_a_tf1_session():
    r = hvd.rank()
    with tf.Graph().as_default():
        v = tf.compat.v1.get_variable("v", initializer=tf.constant([r + 1.0, 2.0]), use_resource=True)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            state = hvd.elastic.TensorFlowState(session=sess, step=r)  # the graph's global variables
            state.sync()
            np.testing.assert_array_equal(sess.run(v), [1.0, 2.0])
            assert state.step == 0
            sess.run(v.assign([9.0, 9.0]))
            state.restore()
            np.testing.assert_array_equal(sess.run(v), [1.0, 2.0])
            sess.run(v.assign([3.0, 4.0]))
            state.commit()
            sess.run(v.assign([0.0, 0.0]))
            state.restore()
            np.testing.assert_array_equal(sess.run(v), [3.0, 4.0])
