"""Python functions as operations of MXNet's dependency engine (``MXEnginePushAsyncND`` / ``…SyncND``).

An operation names the NDArrays it reads and those it writes; MXNet runs it
once every earlier writer of what it reads (and every earlier reader and
writer of what it writes) is done, and holds back every later operator that
touches those arrays until it completes.  This is how MXNet's own KVStore
overlaps communication with the backward pass, and how hora's parameter-server
store does it through :func:`push_async`: the function starts the network
requests on an engine thread and returns; the :class:`Completion` it receives
is called, from any thread, once the data has arrived.

The functions run on MXNet's engine threads, so they must never wait on the
engine (``wait_to_read``, ``asnumpy``, ``mx.nd.waitall``): views of the
arrays they list are safe to use as they are.  A function that raises is
logged, and an asynchronous one is completed anyway, so that nothing waits
forever; callers catch and report their own errors.

An operation must not list an array twice among those it writes (MXNet then
waits on itself forever); arrays it only reads may repeat.  With
``MXNET_ENGINE_TYPE=NaiveEngine`` MXNet needs every operation to complete
before the push returns, so :func:`available` is False there.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import threading
from collections.abc import Callable, Sequence

import mxnet as mx
from mxnet.base import _LIB, check_call

log = logging.getLogger(__name__)

_ASYNC = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)  # (rctx, on_complete, param)
_SYNC = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)  # (rctx, param)
_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)  # (engine, param, error)


class _OnComplete(ctypes.Structure):
    """``mxnet::engine::CallbackOnComplete`` (include/mxnet/engine.h): three pointers."""

    _fields_ = [("callback", ctypes.c_void_p), ("engine", ctypes.c_void_p), ("param", ctypes.c_void_p)]


class _Context(ctypes.Structure):
    """``mxnet::Context``: the device type (1 = CPU) and id."""

    _fields_ = [("dev_type", ctypes.c_int32), ("dev_id", ctypes.c_int32)]


_PUSH_ARGS = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(_Context),
              ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
              ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p]
try:  # MXNet >= 1.6 exports them
    _push_async_nd = ctypes.CFUNCTYPE(ctypes.c_int, *_PUSH_ARGS, ctypes.c_bool)(("MXEnginePushAsyncND", _LIB))
    _push_sync_nd = ctypes.CFUNCTYPE(ctypes.c_int, *_PUSH_ARGS)(("MXEnginePushSyncND", _LIB))
except AttributeError:
    _push_async_nd = _push_sync_nd = None
_CPU = _Context(1, 0)

_ops: dict[int, Callable] = {}  # id -> the Python function of an operation not yet run
_ids = itertools.count(1)
_lock = threading.Lock()


class Completion:
    """Tells MXNet that an asynchronous operation is done; call it once, from any thread (later calls
    do nothing)."""

    __slots__ = ("_callback", "_engine", "_param", "_done", "_lock")

    def __init__(self, on_complete: int) -> None:
        # MXNet passes a pointer to a CallbackOnComplete on the engine thread's stack: copy it now.
        c = _OnComplete.from_address(on_complete)
        self._callback, self._engine, self._param = c.callback, c.engine, c.param
        self._done = False
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        _CALLBACK(self._callback)(self._engine, self._param, None)


def _take(param: int | None) -> Callable | None:
    with _lock:
        return _ops.pop(param or 0, None)


def _run_async(rctx: int, on_complete: int, param: int | None) -> None:
    done = Completion(on_complete)
    fn = _take(param)
    try:
        if fn is None:
            log.error("an MXNet engine operation of hora ran without its function; completing it")
            done()
            return
        fn(done)
    except BaseException:
        log.exception("an asynchronous MXNet engine operation of hora failed; completing it")
        done()


def _run_sync(rctx: int, param: int | None) -> None:
    fn = _take(param)
    try:
        if fn is not None:
            fn()
    except BaseException:
        log.exception("an MXNet engine operation of hora failed")


# Kept for the life of the process: MXNet calls them from its threads.
_ASYNC_FN = _ASYNC(_run_async)
_SYNC_FN = _SYNC(_run_sync)


def available() -> bool:
    """True when this MXNet takes Python operations and lets them complete after their push returns (not
    under ``MXNET_ENGINE_TYPE=NaiveEngine``)."""
    return _push_async_nd is not None and "naive" not in os.environ.get("MXNET_ENGINE_TYPE", "").lower()


def _handles(arrays: Sequence[mx.nd.NDArray]) -> tuple[ctypes.Array, int]:
    return (ctypes.c_void_p * max(1, len(arrays)))(*[a.handle.value for a in arrays]), len(arrays)


def _push(fn: Callable, reads: Sequence[mx.nd.NDArray], writes: Sequence[mx.nd.NDArray], priority: int,
          name: str, asynchronous: bool) -> None:
    if _push_async_nd is None or _push_sync_nd is None:
        raise RuntimeError("this MXNet has no MXEnginePushAsyncND/MXEnginePushSyncND (they came in MXNet 1.6)")
    if len({a.handle.value for a in writes}) != len(writes):
        raise ValueError(f"engine operation {name}: an NDArray is listed twice among those it writes")
    with _lock:
        op_id = next(_ids)
        _ops[op_id] = fn
    const, n_const = _handles(reads)
    mutable, n_mutable = _handles(writes)
    try:
        if asynchronous:
            check_call(_push_async_nd(_ASYNC_FN, op_id, None, ctypes.byref(_CPU), const, n_const, mutable, n_mutable,
                                      None, int(priority), name.encode(), False))
        else:
            check_call(_push_sync_nd(_SYNC_FN, op_id, None, ctypes.byref(_CPU), const, n_const, mutable, n_mutable,
                                     None, int(priority), name.encode()))
    except BaseException:
        _take(op_id)
        raise


def push_async(fn: Callable[[Completion], None], reads: Sequence[mx.nd.NDArray], writes: Sequence[mx.nd.NDArray],
               priority: int = 0, name: str = "hora_async") -> None:
    """Run ``fn(done)`` on an engine thread once ``reads`` and ``writes`` are ready; the operation ends
    when ``done()`` is called (by ``fn`` or later, from any thread)."""
    _push(fn, reads, writes, priority, name, asynchronous=True)


def push_sync(fn: Callable[[], None], reads: Sequence[mx.nd.NDArray], writes: Sequence[mx.nd.NDArray],
              priority: int = 0, name: str = "hora_sync") -> None:
    """Run ``fn()`` on an engine thread once ``reads`` and ``writes`` are ready; the operation ends when it
    returns."""
    _push(fn, reads, writes, priority, name, asynchronous=False)
