"""Horovod's TensorFlow collectives on hora's core, eagerly and inside ``tf.function`` or a TF1 graph.

Each op has one eager body that hands NumPy views of its tensors to
:func:`hora.core.collectives.submit` and waits.  Called eagerly, the body runs
at once; while a graph is being built (``tf.function``, Keras's compiled train
step, a ``tf.compat.v1`` graph) it becomes a ``tf.py_function`` node that runs
the same body when the graph executes.  Every differentiable op registers its
gradient next to itself with ``tf.custom_gradient``, as Horovod defines them:
allreduce's gradient is the allreduce of the upstream gradient, allgather's
keeps this rank's rows of the averaged gradient, broadcast's sends the
averaged gradient to the root, alltoall's is the reverse alltoall and
reducescatter's is an allgather.

When ranks disagree (shape, dtype, op, root), every rank raises
:class:`CollectiveFailedError`, a ``tf.errors.FailedPreconditionError`` naming
the tensor, as Horovod's TensorFlow ops do.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from hora.core import collectives, runtime
from hora.core.api import Adasum, Average, Max, Min, Product, Sum
from hora.core.collectives import Adapter
from hora.core.frontend import resolve_op
from hora.core.ops import CollectiveType, ReduceOp
from hora.core.runtime import ProcessSet, global_process_set
from hora.errors import HoraError, InternalError, UnsupportedError

log = logging.getLogger(__name__)


_SUPPORTED = (tf.uint8, tf.int8, tf.int16, tf.int32, tf.int64, tf.float16, tf.bfloat16, tf.float32, tf.float64,
              tf.bool)


class CollectiveFailedError(tf.errors.FailedPreconditionError, HoraError):
    """A collective failed on every rank (ranks disagreed, a rank stalled or shut down).

    It is TensorFlow's ``FailedPreconditionError``, which Horovod's TF ops
    raise and scripts catch, and a :class:`hora.errors.HoraError`; the message
    names the tensor and what each rank submitted.
    """

    def __init__(self, message: str) -> None:
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)

    def __reduce__(self):
        return (CollectiveFailedError, (self.message,))


#: starts the message of a collective that failed because a peer was lost (or the engine shut down): in a
#: graph only the message leaves the op, and ``hvd.elastic.run`` recognises the failure by it.
LOST_PEER_TAG = "[hora: peer lost] "


class CollectiveAbortedError(CollectiveFailedError, InternalError):
    """A collective failed because a peer was lost or the engine shut down (hora's :class:`InternalError`).

    Both TensorFlow's ``FailedPreconditionError`` and hora's ``InternalError``,
    so that ``hvd.elastic.run`` restores the last commit and re-forms the ring.
    """

    def __reduce__(self):
        return (CollectiveAbortedError, (self.message,))


def failed_collective(error: HoraError) -> CollectiveFailedError:
    """The TensorFlow error for a failed collective: :class:`CollectiveAbortedError` when a peer was lost."""
    if isinstance(error, InternalError):
        return CollectiveAbortedError(LOST_PEER_TAG + str(error))
    return CollectiveFailedError(str(error))


def lost_peer(error: BaseException) -> bool:
    """True for a TensorFlow error that a lost peer caused, eagerly or inside a graph (see :data:`LOST_PEER_TAG`)."""
    return isinstance(error, InternalError) or (isinstance(error, tf.errors.OpError)
                                                and LOST_PEER_TAG in (error.message or ""))


class InvalidArgumentsError(tf.errors.InvalidArgumentError, ValueError):
    """An op's arguments cannot work on this rank (alltoall's splits against the tensor's rows).

    It is TensorFlow's ``InvalidArgumentError``, as Horovod's ops raise for
    these, and a ``ValueError``.
    """

    def __init__(self, message: str) -> None:
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)

    def __reduce__(self):
        return (InvalidArgumentsError, (self.message,))


def _to_buffer(t: Any) -> np.ndarray:
    # np.asarray views an eager CPU tensor's memory (read-only) where .numpy() copies it; the engine only
    # reads inputs (every TF op here writes new outputs), and it keeps a scalar a 0-d array.
    return t if isinstance(t, np.ndarray) else np.asarray(t)


#: eager tensors in (as NumPy arrays: on a GPU this copies through host memory), tf.Tensors out.
TF_ADAPTER = Adapter(to_buffer=_to_buffer, from_buffer=tf.convert_to_tensor)
#: NumPy views of eager tensors in, the binding's own output arrays out (see _wait_into)
_ENGINE_ARRAYS = Adapter(to_buffer=None, from_buffer=None)


def _executing_eagerly() -> bool:
    return tf.executing_eagerly()


def _normalize_name(name: str) -> str:
    """A graph tensor's name as a collective name (Horovod's convention: no ``:`` or ``/``)."""
    return re.sub("[^a-zA-Z0-9_]", "_", name)


def _graph_name(prefix: str, tensor: Any, name: str | None) -> str | None:
    """In a graph, collectives without a name are named after their input, so every rank agrees
    on the name whatever order the graph's nodes run in (a TF1 session runs them concurrently)."""
    if tf.executing_eagerly():
        return name
    return _node_name(f"{prefix}_{_normalize_name(tensor.name)}" if name is None else name)


def _node_name(name: str) -> str:
    """A TF1 graph's collective gets a name no other node of the graph has, as the graph names its ops:
    its session may run several collectives on one tensor (or of one name) at the same time.  Inside a
    ``tf.function`` they run one after the other, and keep the name they are given."""
    if tf.inside_function():
        return name
    return _normalize_name(tf.compat.v1.get_default_graph().unique_name(name))


def _pset(process_set: ProcessSet | None) -> ProcessSet:
    return global_process_set if process_set is None else process_set


def _pset_ranks(process_set: ProcessSet | None) -> list[int]:
    ps = _pset(process_set)
    return ps.ranks if ps.ranks is not None else list(range(runtime.current().engine.size))


def _check_dtype(t: Any, what: str) -> None:
    if t.dtype.base_dtype not in _SUPPORTED:
        raise TypeError(f"{what} does not support dtype {t.dtype.name}; supported: "
                        + ", ".join(d.name for d in _SUPPORTED))


def _wait(kind: CollectiveType, tensors: Sequence[Any], name: str | None, **kwargs: Any) -> list[Any]:
    """Submit eager tensors and wait; a failed collective becomes a FailedPreconditionError."""
    handle = collectives.submit(kind, tensors, name=name, adapter=TF_ADAPTER, wake=False, **kwargs)
    try:
        return handle.wait()
    except HoraError as e:
        raise failed_collective(e) from e


_ALIGN = 64  # TensorFlow's CPU tensors are 64-byte aligned, and it aborts on one that is not


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array whose memory starts on a 64-byte boundary (so TensorFlow can adopt it).

    Called for every result of every step: ``math.prod`` and the array
    interface cost ~1 us where ``np.prod`` and ``ndarray.ctypes`` cost ~20 us.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    offset = -raw.__array_interface__["data"][0] % _ALIGN
    return raw[offset: offset + nbytes].view(dtype).reshape(shape)


#: dtype -> whether DLPack can hand its arrays to TensorFlow (``dtype.name`` costs ~5 us a call)
_DLPACK_DTYPES: dict[np.dtype, bool] = {}


def _adopt(a: np.ndarray) -> tf.Tensor:
    """A tf.Tensor sharing the memory of an aligned array that nothing else holds, through DLPack.

    ``tf.convert_to_tensor`` copies every array (7.5 MB of gradients a step for
    the benchmark's MLP, the largest part of hora's cost in a train step);
    DLPack hands the memory over.  Types DLPack has no code for (bfloat16)
    and empty arrays are converted.
    """
    dlpack = _DLPACK_DTYPES.get(a.dtype)
    if dlpack is None:
        dlpack = _DLPACK_DTYPES[a.dtype] = a.dtype.kind in "biuf" and a.dtype.name != "bfloat16"
    if dlpack and a.size:
        return tf.experimental.dlpack.from_dlpack(a.__dlpack__())
    return tf.convert_to_tensor(a)


def _wait_into(kind: CollectiveType, tensors: Sequence[Any], name: str | None, **kwargs: Any) -> list[Any]:
    """:func:`_wait` for allreduce and broadcast: the engine writes into aligned arrays that become the
    result tensors without a copy."""
    buffers = [_to_buffer(t) for t in tensors]
    outputs = [_aligned_empty(b.shape, b.dtype) for b in buffers]
    handle = collectives.submit(kind, buffers, name=name, adapter=_ENGINE_ARRAYS, outputs=outputs, wake=False,
                                **kwargs)
    try:
        handle.wait()
    except HoraError as e:
        raise failed_collective(e) from e
    return [_adopt(o) for o in outputs]


# ---------------------------------------------------------------------------- graph/eager dispatch
#: Horovod's ops run as written inside ``tf.function``: AutoGraph would otherwise convert them and the
#: ``py_function`` bodies they define, whose every call at run time then goes through AutoGraph's dispatch
#: (``converted_call``, its type checks and logging; 0.1-0.3 ms a step for the benchmark's grouped allreduce).
#: They branch only on Python values, and work in TF1 graphs, which have no AutoGraph.
_plain_python = tf.autograph.experimental.do_not_convert

_FAILED_PREFIX = "/dev/null/"
#: the first character of a failed op's status output: which TensorFlow error the graph raises
_FAILED, _INVALID = "F", "I"


def _call(body: Callable[..., list[Any]], inputs: Sequence[Any], tout: Sequence[tf.DType],
          shapes: Sequence[tf.TensorShape | None]) -> list[Any]:
    """Run ``body`` on eager tensors now, or add it to the graph being built.

    In a graph, a Python exception inside a ``py_function`` surfaces as
    ``UnknownError``.  A failed collective therefore returns its message as an
    extra output instead, and a ``tf.cond`` branch taken only then raises the
    error class eager code gets: an assertion for ``InvalidArgumentError``,
    and for ``FailedPreconditionError`` the only op TensorFlow offers that
    fails with that class and a message chosen at run time, writing below
    ``/dev/null`` ("Not a directory").
    """
    if tf.executing_eagerly():
        return list(body(*inputs))

    def guarded(*xs):
        try:
            return [*body(*xs), _ok_status()]
        except CollectiveFailedError as e:
            status = _FAILED + e.message
        except InvalidArgumentsError as e:
            status = _INVALID + e.message
        return [*(_empty_like(dt, s) for dt, s in zip(tout, shapes, strict=True)), tf.constant(status)]

    outs = _graph_node(guarded, list(inputs), [*tout, tf.string])
    status = outs[-1]
    status.set_shape([])

    def fail() -> tf.Tensor:
        message = tf.strings.substr(status, 1, tf.strings.length(status))
        invalid = tf.debugging.Assert(tf.not_equal(tf.strings.substr(status, 0, 1), _INVALID), [message],
                                      summarize=1)
        with tf.control_dependencies([invalid]):
            failed = tf.io.write_file(tf.strings.join([_FAILED_PREFIX, message]), "")
        with tf.control_dependencies([failed]):
            return tf.identity(status)

    checked = tf.cond(tf.equal(status, ""), lambda: tf.identity(status), fail)
    results = []
    with tf.control_dependencies([checked]):
        for o, s in zip(outs[:-1], shapes, strict=True):
            o = tf.identity(o)
            if s is not None:
                o.set_shape(s)
            results.append(o)
    return results


_OK_STATUS: list[tf.Tensor] = []


def _ok_status() -> tf.Tensor:
    """The empty status string a collective that succeeded returns from its ``py_function``.

    One eager tensor, made on first use and returned every time: a fresh
    ``tf.constant`` inside a ``py_function`` costs ~0.2 ms, a tenth of what
    the Keras benchmark's grouped allreduce costs a step on one rank.
    """
    if not _OK_STATUS:
        _OK_STATUS.append(tf.constant(""))
    return _OK_STATUS[0]


def _graph_node(fn: Callable[..., list[Any]], inputs: list[tf.Tensor], tout: list[tf.DType]) -> list[tf.Tensor]:
    """``fn`` as a node of the graph being built, returning tensors of dtypes ``tout``.

    Inside a ``tf.function`` (Keras's train step included) it is a plain
    ``py_function``: TensorFlow runs a function's stateful ops in program
    order, so every rank reaches its collectives in the same order.

    A TF1 session gives no such order: it runs the independent collectives
    fetched by one ``session.run`` in whatever order its executor picks, which
    differs between ranks, on as few as one inter-op thread (hora gives each
    rank cores / local ranks).  A ``py_function`` there would hold that thread
    while it waits for the other ranks, which may be waiting for a collective
    this rank has not started: a deadlock.  So in a TF1 graph ``fn`` runs off
    the session's threads, as the map of a one-element ``tf.data`` pipeline
    with its own thread, read by ``DatasetToSingleElement``: an asynchronous
    kernel, which frees the session's thread for the next collective while
    this one waits.
    """
    if tf.inside_function():
        return tf.py_function(fn, inputs, tout)
    n = len(inputs)
    carried = tuple(inputs) if inputs else (tf.zeros([0], tf.int8),)

    def element(*xs):
        return tuple(tf.py_function(fn, list(xs[:n]), tout))

    dataset = tf.data.Dataset.from_tensors(carried).map(element)
    unknown = [tf.TensorShape(None)] * len(tout)
    own_thread = tf.raw_ops.PrivateThreadPoolDataset(
        input_dataset=tf.data.experimental.to_variant(dataset), num_threads=tf.constant(1, tf.int64),
        output_types=tout, output_shapes=unknown)
    return list(tf.raw_ops.DatasetToSingleElement(dataset=own_thread, output_types=tout, output_shapes=unknown))


def _empty_like(dtype: tf.DType, shape: tf.TensorShape | None) -> tf.Tensor:
    dims = [0 if d is None else d for d in (shape.as_list() if shape is not None and shape.rank is not None
                                             else [0])]
    return tf.zeros(dims, dtype=dtype)


def _differentiable(forward: Callable[..., Any], backward: Callable[..., Any], inputs: Sequence[Any]) -> Any:
    """``forward(*inputs)`` with ``backward(*upstream)`` as its registered gradient (float inputs only)."""
    if not all(t.dtype.is_floating for t in inputs):
        return forward(*inputs)

    @tf.custom_gradient
    def op(*xs):
        ys = forward(*xs)

        def grad(*dys):
            return backward(*dys)

        return ys, grad

    return op(*inputs)


def _carried(t: tf.Tensor) -> tf.Tensor:
    """uint16, which the engine has no type for, travels as int16 bits in ops that do no arithmetic."""
    return tf.bitcast(t, tf.int16) if t.dtype == tf.uint16 else t


def _restored(t: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    return tf.bitcast(t, tf.uint16) if dtype == tf.uint16 else t


def _as_tensors(tensors: Sequence[Any]) -> list[tf.Tensor]:
    return [tf.convert_to_tensor(t) for t in tensors]


# ------------------------------------------------------------------------------------ allreduce
def _allreduce_raw(tensors: list[tf.Tensor], name: str | None, op: ReduceOp, prescale: float, postscale: float,
                   process_set: ProcessSet | None) -> list[tf.Tensor]:
    def body(*xs):
        return _wait_into(CollectiveType.ALLREDUCE, xs, name, op=op, prescale=prescale, postscale=postscale,
                     process_set=process_set)

    return _call(body, tensors, [t.dtype for t in tensors], [t.shape for t in tensors])


def _grouped_allreduce_tensors(tensors: list[tf.Tensor], name: str | None, op: ReduceOp, prescale: float,
                               postscale: float, process_set: ProcessSet | None) -> list[tf.Tensor]:
    for t in tensors:
        _check_dtype(t, "allreduce")
        if t.dtype == tf.bool and op == Average:
            raise TypeError("allreduce: op=Average is undefined for bool tensors; use Sum (any) or Min (all)")

    def forward(*xs):
        return _allreduce_raw(list(xs), name, op, prescale, postscale, process_set)

    def backward(*dys):
        dys = _as_tensors(dys)
        return _grouped_allreduce_tensors(dys, _graph_name("HorovodAllreduceGrad", dys[0], None), op, prescale,
                                          postscale, process_set)

    out = _differentiable(forward, backward, tensors)
    return list(out)


def compressed_allreduce(tensors: Sequence[Any], names: Sequence[str], compressor: Any, op: ReduceOp = Average,
                         prescale: float = 1.0, postscale: float = 1.0,
                         process_set: ProcessSet | None = global_process_set) -> list[tf.Tensor]:
    """Reduce a step's dense gradients through a stateful compressor (:mod:`hora.core.compression`).

    The compressor works on NumPy copies of the tensors, in place, and keeps
    its per-tensor state under ``names`` (the same on every rank and step).
    Eager, inside ``tf.function`` and in TF1 graphs, like every collective
    here; not differentiable (it reduces gradients).
    """
    tensors = _as_tensors(tensors)
    compressor.check_op(op)

    def body(*xs):
        buffers = []
        for x in xs:
            a = _to_buffer(x)
            out = _aligned_empty(a.shape, a.dtype)
            np.copyto(out, a)
            buffers.append(out)
        try:
            compressor.reduce(buffers, list(names), op=op, prescale=prescale, postscale=postscale,
                              process_set=process_set)
        except HoraError as e:
            raise failed_collective(e) from e
        return [_adopt(b) for b in buffers]

    return _call(body, tensors, [t.dtype for t in tensors], [t.shape for t in tensors])


def _indexed_slices_allreduce(slices: tf.IndexedSlices, op: ReduceOp, prescale: float, postscale: float,
                              process_set: ProcessSet | None) -> tf.IndexedSlices:
    if op not in (Sum, Average):
        raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
    if prescale != 1.0 or postscale != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")
    values = allgather(slices.values, process_set=process_set)
    indices = allgather(slices.indices, process_set=process_set)
    if op == Average:
        values = values / tf.cast(len(_pset_ranks(process_set)), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


@_plain_python
def allreduce(tensor, average=None, device_dense="", device_sparse="", compression=None, op=None,
              prescale_factor=1.0, postscale_factor=1.0, name=None, process_set=global_process_set,
              ignore_name_scope=False):
    """Reduce a ``tf.Tensor``, ``tf.Variable`` or ``tf.IndexedSlices`` over the ranks of the process set.

    Dense tensors are reduced with ``op`` (Average by default, Sum, Min, Max,
    Product) after multiplying by ``prescale_factor`` and before
    ``postscale_factor``; ``IndexedSlices`` are allgathered (Sum or Average
    only), as in Horovod.  Works eagerly and in graphs, with a gradient.
    """
    from hora.tensorflow.compression import Compression

    try:
        op = resolve_op(average, op)
    except UnsupportedError as e:
        raise NotImplementedError(str(e)) from e
    if isinstance(tensor, tf.IndexedSlices):
        return _indexed_slices_allreduce(tensor, op, prescale_factor, postscale_factor, process_set)
    compression = compression or Compression.none
    tensor = tf.convert_to_tensor(tensor)
    compressed, ctx = compression.compress(tensor)
    name = _graph_name("HorovodAllreduce", tensor, name)
    (out,) = _grouped_allreduce_tensors([compressed], name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(out, ctx)


@_plain_python
def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="", compression=None, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set, name=None):
    """Reduce a list of tensors as one unit: one negotiation, one fused collective.

    ``IndexedSlices`` in the list are allgathered one by one, uncompressed; the
    dense tensors travel together.
    """
    from hora.tensorflow.compression import Compression

    if not tensors:
        return []
    try:
        op = resolve_op(average, op)
    except UnsupportedError as e:
        raise NotImplementedError(str(e)) from e
    compression = compression or Compression.none
    pairs = [(t, None) if isinstance(t, tf.IndexedSlices) else compression.compress(tf.convert_to_tensor(t))
             for t in tensors]
    outs = allreduce_group([c for c, _ in pairs], op=op, prescale_factor=prescale_factor,
                           postscale_factor=postscale_factor, process_set=process_set, name=name)
    return [o if isinstance(t, tf.IndexedSlices) else compression.decompress(o, ctx)
            for t, o, (_, ctx) in zip(tensors, outs, pairs, strict=True)]


@_plain_python
def allreduce_group(tensors: Sequence[Any], *, op: ReduceOp, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set,
                    name: str | None = None) -> list[Any]:
    """Reduce a list of tensors as one unit with an operator already resolved, and no compression.

    What :func:`grouped_allreduce` and the gradient reductions of
    :mod:`hora.tensorflow.gradients` submit: the dense tensors go as one
    grouped allreduce, ``IndexedSlices`` are allgathered one by one.
    """
    results: list[Any] = [None] * len(tensors)
    dense_idx = []
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            results[i] = _indexed_slices_allreduce(t, op, prescale_factor, postscale_factor, process_set)
        else:
            dense_idx.append(i)
    if dense_idx:
        dense = [tf.convert_to_tensor(tensors[i]) for i in dense_idx]
        outs = _grouped_allreduce_tensors(dense, _graph_name("HorovodGroupedAllreduce", dense[0], name), op,
                                          prescale_factor, postscale_factor, process_set)
        for i, o in zip(dense_idx, outs, strict=True):
            results[i] = o
    return results


# ------------------------------------------------------------------------------------ allgather
def _allgather_tensors(tensors: list[tf.Tensor], name: str | None, process_set: ProcessSet | None) -> list[Any]:
    for t in tensors:
        _check_dtype(t, "allgather")
        if t.shape.rank == 0:
            raise ValueError("allgather needs tensors with at least one dimension (got a scalar); "
                             "use tf.reshape(t, [1])")

    def body(*xs):
        return _wait(CollectiveType.ALLGATHER, xs, name, process_set=process_set)

    def forward(*xs):
        shapes = [tf.TensorShape([None]).concatenate(x.shape[1:]) if x.shape.rank is not None else None
                  for x in xs]
        return _call(body, list(xs), [x.dtype for x in xs], shapes)

    def backward(*dys):
        dys = _as_tensors(dys)
        reduced = _grouped_allreduce_tensors(dys, _graph_name("HorovodAllgatherGrad", dys[0], None), Average, 1.0,
                                             1.0, process_set)
        rows = tf.stack([tf.shape(t, out_type=tf.int64)[0] for t in tensors])
        rows2d = tf.reshape(rows, [1, -1])
        counts = _allgather_tensors([rows2d], _graph_name("HorovodAllgatherRows", rows2d, None), process_set)[0]
        me = _pset_ranks(process_set).index(runtime.current().engine.rank)
        offsets = tf.reduce_sum(counts[:me], axis=0)
        return [tf.slice(g, tf.concat([[offsets[i]], tf.zeros([tf.rank(g) - 1], tf.int64)], 0),
                         tf.concat([[rows[i]], tf.shape(g, out_type=tf.int64)[1:]], 0))
                for i, g in enumerate(reduced)]

    return list(_differentiable(forward, backward, tensors))


@_plain_python
def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Concatenate every rank's ``tensor`` along the first dimension (which may differ between ranks)."""
    tensor = tf.convert_to_tensor(tensor)
    out = _allgather_tensors([_carried(tensor)], _graph_name("HorovodAllgather", tensor, name), process_set)[0]
    return _restored(out, tensor.dtype)


@_plain_python
def grouped_allgather(tensors, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Allgather a list of tensors as one unit."""
    tensors = _as_tensors(tensors)
    if not tensors:
        return []
    outs = _allgather_tensors([_carried(t) for t in tensors],
                              _graph_name("HorovodGroupedAllgather", tensors[0], name), process_set)
    return [_restored(o, t.dtype) for o, t in zip(outs, tensors, strict=True)]


# ------------------------------------------------------------------------------------ broadcast
def _check_root(root_rank: int, process_set: ProcessSet | None, what: str) -> None:
    ranks = _pset_ranks(process_set)
    if int(root_rank) not in ranks:
        raise ValueError(f"{what}: root_rank={root_rank} is not a rank of the process set {ranks}")


def _broadcast_tensors(tensors: list[tf.Tensor], root_rank: int, name: str | None,
                       process_set: ProcessSet | None) -> list[Any]:
    for t in tensors:
        _check_dtype(t, "broadcast")
    _check_root(root_rank, process_set, "broadcast")

    def body(*xs):
        return _wait_into(CollectiveType.BROADCAST, xs, name, root=int(root_rank), process_set=process_set)

    def forward(*xs):
        return _call(body, list(xs), [x.dtype for x in xs], [x.shape for x in xs])

    def backward(*dys):
        dys = _as_tensors(dys)
        reduced = _grouped_allreduce_tensors(dys, _graph_name("HorovodBroadcastGrad", dys[0], None), Average, 1.0,
                                             1.0, process_set)
        if runtime.current().engine.rank != int(root_rank):
            reduced = [r * 0 for r in reduced]
        return reduced

    return list(_differentiable(forward, backward, tensors))


@_plain_python
def broadcast(tensor, root_rank, name=None, ignore_name_scope=False, process_set=global_process_set):
    """The root's ``tensor`` on every rank of the process set."""
    tensor = tf.convert_to_tensor(tensor)
    out = _broadcast_tensors([_carried(tensor)], root_rank, _graph_name("HorovodBroadcast", tensor, name),
                             process_set)[0]
    return _restored(out, tensor.dtype)


@_plain_python
def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Overwrite ``variables`` (a list of ``tf.Variable``) with the root's values, in place.

    Returns:
        The variables' new values, one tensor per variable.
    """
    variables = list(variables)
    if not variables:
        return []
    if not tf.executing_eagerly():
        name = _node_name(name or "HorovodBroadcastInplace_" + "_".join(_normalize_name(v.name)
                                                                        for v in variables)[:200])
    values = _broadcast_tensors([tf.convert_to_tensor(v) for v in variables], root_rank, name, process_set)
    if tf.executing_eagerly():
        for v, x in zip(variables, values, strict=True):
            v.assign(x)
        return [tf.convert_to_tensor(v) for v in variables]
    assigns = [_assign_in_graph(v, x) for v, x in zip(variables, values, strict=True)]
    with tf.control_dependencies(assigns):
        return [tf.identity(a) for a in assigns]


def _assign_in_graph(variable: Any, value: tf.Tensor) -> tf.Tensor:
    """Assign in a graph; returns the new value, ordered after the assignment."""
    if isinstance(variable, tf.Variable):
        return tf.compat.v1.assign(variable, value)
    # A Keras 3 variable (tf.keras on TF >= 2.16, as in Horovod's TF2 examples inside tf.function) is no
    # tf.Variable: its own assign writes the TF variable it wraps, and tf.function orders the read after it.
    variable.assign(value)
    return tf.convert_to_tensor(variable)


# ------------------------------------------------------------------------------------- alltoall
def _splits_values(splits: Any, n: int, rows: int | None) -> list[int] | None:
    if splits is None:
        return None
    values = [int(v) for v in np.asarray(splits).reshape(-1)]
    if len(values) != n:
        raise InvalidArgumentsError(f"alltoall: splits has {len(values)} entries but the process set has {n} "
                                    "ranks")
    if any(v < 0 for v in values) or (rows is not None and sum(values) > rows):
        raise InvalidArgumentsError(f"alltoall: splits {values} must be non-negative and sum to at most the first "
                         f"dimension ({rows})")
    return values


def _alltoall_tensor(tensor: tf.Tensor, splits: Any, name: str | None, process_set: ProcessSet | None):
    _check_dtype(tensor, "alltoall")
    if tensor.shape.rank == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension (got a scalar)")
    n = len(_pset_ranks(process_set))
    if splits is not None:
        splits_t = tf.convert_to_tensor(splits)
        if splits_t.dtype.is_floating or splits_t.dtype == tf.bool:
            raise ValueError(f"alltoall expects integer splits, got {splits_t.dtype.name}")
        splits_t = tf.cast(splits_t, tf.int32)
    else:
        splits_t = tf.zeros([0], tf.int32)
    if tf.executing_eagerly():
        rows = int(tensor.shape[0])
        if splits is None and rows % n:
            raise InvalidArgumentsError(f"alltoall: splits not given, and the first dimension ({rows}) does not "
                                        f"divide evenly among the {n} ranks of the process set")
        _splits_values(splits_t.numpy() if splits is not None else None, n, rows)

    def body(x, s):
        values = _splits_values(s.numpy(), n, int(x.shape[0])) if splits is not None else None
        if values is None and x.shape[0] % n:
            raise InvalidArgumentsError(f"alltoall: splits not given, and the first dimension ({x.shape[0]}) "
                                        f"does not divide evenly among the {n} ranks of the process set")
        if values is not None and sum(values) < x.shape[0]:
            x = x[: sum(values)]
        ((out, received),) = _wait(CollectiveType.ALLTOALL, [x], name, splits=[values], process_set=process_set)
        return [out, tf.constant(np.asarray(received, dtype=np.int32))]

    def forward(x):
        shape = tf.TensorShape([None]).concatenate(x.shape[1:]) if x.shape.rank is not None else None
        out, received = _call(body, [x, splits_t], [x.dtype, tf.int32], [shape, tf.TensorShape([n])])
        return out, received

    if not tensor.dtype.is_floating:
        return forward(tensor)

    @tf.custom_gradient
    def op(x):
        out, received = forward(x)

        def grad(dy, _dsplits=None):
            dy = tf.convert_to_tensor(dy)
            back, _ = _alltoall_tensor(dy, received, _graph_name("HorovodAlltoallGrad", dy, None), process_set)
            return back

        return (out, received), grad

    return op(tensor)


@_plain_python
def alltoall(tensor, splits=None, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Send ``splits[i]`` rows of ``tensor`` to rank i and gather the rows every rank sends here.

    Returns:
        The gathered tensor, and with ``splits`` given also the rows received
        from each rank, ``(output, received_splits)``, as Horovod does.
    """
    tensor = tf.convert_to_tensor(tensor)
    out, received = _alltoall_tensor(_carried(tensor), splits, _graph_name("HorovodAlltoall", tensor, name),
                                     process_set)
    out = _restored(out, tensor.dtype)
    return (out, received) if splits is not None else out


# -------------------------------------------------------------------------------- reducescatter
def _reducescatter_tensors(tensors: list[tf.Tensor], name: str | None, op: ReduceOp, process_set,
                           prescale: float, postscale: float) -> list[Any]:
    if op not in (Average, Sum):
        raise NotImplementedError(f"reducescatter supports op=Average and op=Sum, not {ReduceOp(op).name}")
    for t in tensors:
        _check_dtype(t, "reducescatter")
        if t.shape.rank == 0:
            raise ValueError("reducescatter needs tensors with at least one dimension (got a scalar)")

    def body(*xs):
        return _wait(CollectiveType.REDUCESCATTER, xs, name, op=op, prescale=prescale, postscale=postscale,
                     process_set=process_set)

    def forward(*xs):
        shapes = [tf.TensorShape([None]).concatenate(x.shape[1:]) if x.shape.rank is not None else None
                  for x in xs]
        return _call(body, list(xs), [x.dtype for x in xs], shapes)

    def backward(*dys):
        # Horovod's convention: Sum multiplies by the set size, and the scale factors apply again.
        scale = float(prescale) * float(postscale) * (len(_pset_ranks(process_set)) if op == Sum else 1)
        scaled = [tf.convert_to_tensor(d) * tf.cast(scale, d.dtype) if scale != 1.0 else tf.convert_to_tensor(d)
                  for d in dys]
        return _allgather_tensors(scaled, _graph_name("HorovodReducescatterGrad", scaled[0], None), process_set)

    return list(_differentiable(forward, backward, tensors))


@_plain_python
def reducescatter(tensor, device_dense="", compression=None, op=Average, name=None, process_set=global_process_set,
                  ignore_name_scope=False, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``tensor`` across ranks and keep this rank's block of rows (the first ranks get one more row
    when the first dimension does not divide evenly)."""
    from hora.tensorflow.compression import Compression

    compression = compression or Compression.none
    tensor = tf.convert_to_tensor(tensor)
    compressed, ctx = compression.compress(tensor)
    op = resolve_op(None, op)
    (out,) = _reducescatter_tensors([compressed], _graph_name("HorovodReducescatter", tensor, name), op,
                                    process_set, prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


@_plain_python
def grouped_reducescatter(tensors, device_dense="", compression=None, op=Average, process_set=global_process_set,
                          prescale_factor=1.0, postscale_factor=1.0, name=None):
    """Reducescatter a list of tensors as one unit."""
    from hora.tensorflow.compression import Compression

    compression = compression or Compression.none
    tensors = _as_tensors(tensors)
    if not tensors:
        return []
    pairs = [compression.compress(t) for t in tensors]
    op = resolve_op(None, op)
    outs = _reducescatter_tensors([c for c, _ in pairs], _graph_name("HorovodGroupedReducescatter", tensors[0],
                                                                      name), op, process_set, prescale_factor,
                                  postscale_factor)
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs, strict=True)]


# ------------------------------------------------------------------------------------- control
@_plain_python
def join():
    """Declare that this rank has no more data; it serves the others' allreduces until all have joined.

    Returns:
        A scalar int32 tensor: the rank that joined last.
    """
    def body():
        last = collectives.submit(CollectiveType.JOIN, [], wake=False).wait()
        return [tf.constant(int(last), dtype=tf.int32)]

    return _call(body, [], [tf.int32], [tf.TensorShape([])])[0]


@_plain_python
def barrier(process_set=global_process_set) -> None:
    """Block until every rank of the process set reaches the barrier."""
    collectives.submit(CollectiveType.BARRIER, [], process_set=process_set, wake=False).wait()


def _int_op(value: Callable[[], int], name: str | None) -> tf.Tensor:
    """A scalar int32 read when the graph runs (Horovod's ``*_op`` tensors)."""
    if tf.executing_eagerly():
        return tf.constant(value(), dtype=tf.int32, name=name)
    out = tf.py_function(lambda: tf.constant(value(), dtype=tf.int32), [], tf.int32, name=name)
    out.set_shape([])
    return out


def _topology():
    return runtime.current().engine.topology


@_plain_python
def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """The number of ranks (of a process set) as a tensor evaluated when the graph runs."""
    def value() -> int:
        ps = runtime.current().process_sets.get(process_set_id)
        if ps is None:
            raise ValueError(f"process set {process_set_id} is not registered")
        return len(_pset_ranks(ps))

    return _int_op(value, name)


@_plain_python
def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """1 when this rank belongs to the process set, else 0, as a tensor."""
    def value() -> int:
        ps = runtime.current().process_sets.get(process_set_id)
        if ps is None:
            raise ValueError(f"process set {process_set_id} is not registered")
        return int(runtime.current().engine.rank in _pset_ranks(ps))

    return _int_op(value, name)


@_plain_python
def rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank as a tensor evaluated when the graph runs."""
    return _int_op(lambda: runtime.current().engine.rank, name)


@_plain_python
def local_rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank on its host, as a tensor."""
    return _int_op(lambda: _topology().local_rank, name)


@_plain_python
def local_size_op(name: str | None = None) -> tf.Tensor:
    """The number of processes on this host, as a tensor."""
    return _int_op(lambda: _topology().local_size, name)


@_plain_python
def cross_rank_op(name: str | None = None) -> tf.Tensor:
    """This host's index among the job's hosts, as a tensor."""
    return _int_op(lambda: _topology().cross_rank, name)


@_plain_python
def cross_size_op(name: str | None = None) -> tf.Tensor:
    """The number of hosts, as a tensor."""
    return _int_op(lambda: _topology().cross_size, name)


__all__ = [
    "Adasum", "Average", "CollectiveFailedError", "InvalidArgumentsError", "Max", "Min", "Product", "Sum",
    "TF_ADAPTER", "allgather", "allreduce", "allreduce_group", "alltoall", "barrier", "broadcast", "broadcast_",
    "cross_rank_op", "cross_size_op", "grouped_allgather", "grouped_allreduce", "grouped_reducescatter", "join",
    "local_rank_op", "local_size_op", "process_set_included_op", "rank_op", "reducescatter", "size_op",
]
