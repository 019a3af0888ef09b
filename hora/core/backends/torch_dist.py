"""gloo and NCCL backends, on torch.distributed process groups.

hora builds its own ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` objects on a
prefixed store instead of calling ``init_process_group``: the default group
stays free for the user's own DDP or torch.distributed code, and the engine
can be shut down and initialised again in the same process (elastic
training needs exactly that).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hora.config import interface_names
from hora.core.backends.base import Backend, nothing
from hora.core.buffers import Array
from hora.core.buffers.torch_ops import from_numpy
from hora.core.ops import ReduceOp
from hora.errors import BackendError, HoraError

log = logging.getLogger(__name__)

_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
}

_POLL_INTERVAL = datetime.timedelta(milliseconds=100)
_REDUCIBLE = frozenset({"uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32", "float64"})


def _tensor(buf: Array) -> torch.Tensor:
    """The buffer as a tensor: NumPy arrays are viewed (zero-copy), tensors pass through."""
    return from_numpy(buf) if isinstance(buf, np.ndarray) else buf

# Stores outlive an engine so that init() -> shutdown() -> init() reuses the
# rendezvous port instead of racing to rebind it.
_STORES: dict[tuple[str, int], dist.Store] = {}


def connect_store(addr: str, port: int, rank: int, size: int, is_master: bool, timeout_s: float,
                  secret: str | None = None) -> dist.Store:
    """Open (or reuse) the TCP rendezvous store at ``addr:port``.

    The hosting rank listens on ``addr`` only when it is an IP address (as
    ``hora run`` sets it), not on every interface.  With the job ``secret``
    (``HORA_SECRET``, set by ``hora run``) the store is wrapped in
    :class:`~hora.core.backends.signed_store.SignedStore`: values are signed
    and verified, keys live under a prefix derived from the secret, and every
    rank checks rank 0's signed job token before joining.

    Raises:
        BackendError: the store could not be reached within ``timeout_s``,
            naming the address so a wrong interface or a firewall is easy to spot,
            or it is not this job's store.
    """
    key = (addr, port)
    store = _STORES.get(key)
    if store is None:
        import ipaddress
        import socket

        listen_fd = None
        try:
            literal = bool(ipaddress.ip_address(addr))
        except ValueError:
            literal = False  # a host name may resolve to another address here (127.0.1.1) than elsewhere
        if is_master and literal:
            try:
                listener = socket.create_server((addr, port), backlog=1024)
                listen_fd = listener.detach()
            except OSError as e:
                raise BackendError(f"rank {rank} cannot host the rendezvous store on {addr}:{port} ({e}); is the "
                                   "port in use, and is the rendezvous address one of this host's?") from e
        try:
            store = dist.TCPStore(
                addr, port, world_size=None, is_master=is_master,
                timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False, master_listen_fd=listen_fd,
            )
        except Exception as e:
            raise BackendError(
                f"rank {rank} could not reach the rendezvous store at {addr}:{port} within {timeout_s:g} s "
                f"({e}). Check that rank 0 is running, the address/port are reachable, or raise --start-timeout."
            ) from e
        if secret:
            from hora.core.backends import signed_store

            store = signed_store.SignedStore(store, secret, timeout_s)
            if rank == 0:
                signed_store.write_token(store)
            else:
                signed_store.check_token(store, f"{addr}:{port}")
        _STORES[key] = store
    return store


def release_store(addr: str, port: int) -> None:
    """Forget the store at ``addr:port``, so it closes once its process groups are gone.

    Elastic jobs open a store per rendezvous round, each on its own port;
    without this every round would keep its listener and connections open.
    """
    _STORES.pop((addr, port), None)


class TorchDistBackend(Backend):
    """Common code of the torch.distributed backends."""

    def __init__(self, store: dist.Store, rank: int, size: int, prefix: str, timeout_s: float) -> None:
        super().__init__(rank, size)
        self._store = store
        self._prefix = prefix
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self.pg = self._make_pg(dist.PrefixStore(f"{prefix}/world", store), rank, size)

    def _make_pg(self, store: dist.Store, rank: int, size: int) -> Any:
        raise NotImplementedError

    def _pg(self, group: Any) -> Any:
        return self.pg if group is None else group

    # control plane
    def negotiate(self, vector: np.ndarray, poll: Callable[[float], None], spin_s: float = 200e-6) -> np.ndarray:
        t = torch.from_numpy(vector.copy())
        work = self.pg.allreduce([t])
        # Polling is_completed() starves gloo's own threads (measured: 3.5 ms per 4 KiB allreduce
        # against 0.6 ms for a blocking wait), so block, waking every 100 ms to let poll() act.
        start = time.monotonic()
        while True:
            try:
                work.wait(_POLL_INTERVAL)
                return t.numpy()
            except RuntimeError as e:
                if "timed out" not in str(e):
                    raise
            poll(time.monotonic() - start)

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        n = torch.tensor([len(data)], dtype=torch.int64)
        lengths = torch.empty(self.size, dtype=torch.int64)
        self.pg._allgather_base(lengths, n).wait()
        longest = int(lengths.max())
        send = torch.zeros(longest, dtype=torch.uint8)
        if data:
            send[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        recv = torch.empty(longest * self.size, dtype=torch.uint8)
        self.pg._allgather_base(recv, send).wait()
        raw = recv.numpy().tobytes()
        return [raw[r * longest : r * longest + int(lengths[r])] for r in range(self.size)]

    # data plane
    def allreduce_(self, buf: Array, op: ReduceOp, group: Any = None) -> None:
        buf = _tensor(buf)
        if buf.numel():
            self._allreduce_on(self._pg(group), buf, op).wait()

    @staticmethod
    def _allreduce_on(pg: Any, buf: torch.Tensor, op: ReduceOp) -> Any:
        """Queue an in-place allreduce on ``pg``; returns torch's Work."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = _TORCH_OPS[op]
        return pg.allreduce([buf], opts)

    def allgatherv(self, send: Array, recv: Array, counts: Sequence[int], group: Any = None) -> None:
        send, recv = _tensor(send), _tensor(recv)
        pg = self._pg(group)
        longest = max(counts) if counts else 0
        if longest == 0:
            return
        if all(c == longest for c in counts):
            pg._allgather_base(recv, send).wait()
            return
        padded = torch.zeros(longest, dtype=send.dtype, device=send.device)
        padded[: send.numel()] = send
        gathered = torch.empty(longest * len(counts), dtype=send.dtype, device=send.device)
        pg._allgather_base(gathered, padded).wait()
        offset = 0
        for r, c in enumerate(counts):
            recv[offset : offset + c] = gathered[r * longest : r * longest + c]
            offset += c

    def broadcast_(self, buf: Array, root: int, group: Any = None) -> None:
        buf = _tensor(buf)
        if buf.numel() == 0:
            return
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        self._pg(group).broadcast([buf], opts).wait()

    def alltoallv(
        self,
        send: Array,
        send_counts: Sequence[int],
        recv: Array,
        recv_counts: Sequence[int],
        group: Any = None,
    ) -> None:
        self._pg(group).alltoall_base(_tensor(recv), _tensor(send), list(recv_counts), list(send_counts)).wait()

    def reduce_scatterv(
        self, send: Array, recv: Array, counts: Sequence[int], op: ReduceOp, group: Any = None
    ) -> None:
        send, recv = _tensor(send), _tensor(recv)
        pg = self._pg(group)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = _TORCH_OPS[op]
        longest = max(counts) if counts else 0
        if longest == 0:
            return
        if all(c == longest for c in counts):
            pg._reduce_scatter_base(recv, send, opts).wait()
            return
        # Uneven blocks: pad each to the longest so the collective sees equal chunks.
        padded = torch.zeros(longest * len(counts), dtype=send.dtype, device=send.device)
        offset = 0
        for r, c in enumerate(counts):
            padded[r * longest : r * longest + c] = send[offset : offset + c]
            offset += c
        out = torch.empty(longest, dtype=send.dtype, device=send.device)
        pg._reduce_scatter_base(out, padded, opts).wait()
        recv.copy_(out[: recv.numel()])

    def new_group(self, ranks: Sequence[int], group_id: int) -> Any:
        if self.rank not in ranks:
            return None
        store = dist.PrefixStore(f"{self._prefix}/pset{group_id}", self._store)
        return self._make_pg(store, list(ranks).index(self.rank), len(ranks))

    def shutdown(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except Exception as e:  # pragma: no cover - best effort at teardown
                log.debug("process group shutdown failed: %s", e)


class GlooBackend(TorchDistBackend):
    """CPU collectives over TCP through gloo."""

    name = "gloo"
    reduce_dtypes = _REDUCIBLE
    # A gloo collective costs 0.4-2 ms even for a few bytes, most of it waiting on gloo's own
    # threads, so a round keeps its allreduces in flight together: tensors from 1 MiB go as they
    # are, smaller ones in fused buckets of up to 8 MiB, packed while the buckets before them
    # travel.  Each process set has two gloo groups: one device for negotiation and small
    # collectives (latency: 1.2-1.6 ms per 4 KiB allreduce against 1.9-2.1 ms with four
    # devices), and a bulk group of several devices (connections, each with its own I/O thread)
    # that gloo round-robins collectives over, for allreduces from ``bulk_bytes`` (throughput:
    # ResNet-50's gradient set 1.16-1.18x one flat allreduce on one device, 1.01-1.14x on four).
    # Measurements in docs/benchmarks.md.
    direct_threshold_bytes = 1 << 20
    concurrent = True
    bucket_bytes = 8 << 20
    #: gloo worker threads of the latency group (torch's default is 2).
    threads = 8
    #: gloo worker threads of the bulk group, per device.
    bulk_threads_per_device = 4
    #: allreduces of at least this many bytes run on the bulk group ...
    bulk_bytes = 1 << 20
    #: ... when the round keeps at least this many in flight (or the tensor is split).
    bulk_fanout = 4
    #: a tensor is split over the bulk group's devices only into pieces at least this large.
    split_bytes = 8 << 20

    def __init__(
        self, store: dist.Store, rank: int, size: int, prefix: str, timeout_s: float, interface: str | None = None,
        hostname: str | None = None, devices: int = 4,
    ) -> None:
        self._interface = interface
        self._hostname = hostname
        self._devices = devices
        self._bulk: dict[Any, tuple[Any, int]] = {}  # latency group -> (bulk group, its devices)
        super().__init__(store, rank, size, prefix, timeout_s)

    def allreduce_(self, buf: Array, op: ReduceOp, group: Any = None) -> None:
        self.allreduce_start(buf, op, group)()

    def allreduce_start(
        self, buf: Array, op: ReduceOp, group: Any = None, fanout: int = 1
    ) -> Callable[[], None]:
        """Queue the allreduce; a large tensor goes as up to one piece per bulk device, all in flight.

        A single collective runs on one device's connection; pieces of at
        least ``split_bytes`` on several of them took a 97 MiB allreduce to
        0.88x the time of one call.  A round of fewer than ``bulk_fanout``
        allreduces stays on the latency group unless a tensor is split: for
        the MLP's three (two of 3-4 MiB), four connections made a training
        step 3 ms (~8%) slower than one in two A/B pairs, where ResNet-50's
        thirty gain from them (docs/benchmarks.md).
        """
        buf = _tensor(buf)
        if buf.numel() == 0:
            return nothing
        pg = self._pg(group)
        nbytes = buf.numel() * buf.element_size()
        if nbytes < self.bulk_bytes:
            return self._allreduce_on(pg, buf, op).wait
        bulk, devices = self._bulk[pg]
        pieces = min(devices, nbytes // self.split_bytes)
        if pieces < 2:
            return self._allreduce_on(bulk if fanout >= self.bulk_fanout else pg, buf, op).wait
        works = [self._allreduce_on(bulk, piece, op) for piece in buf.view(-1).chunk(pieces)]

        def wait() -> None:
            for work in works:
                work.wait()

        return wait

    def _make_pg(self, store: dist.Store, rank: int, size: int) -> Any:
        """The latency group of a process set; its bulk group is remembered beside it."""
        latency_devices = self._make_devices(1)
        latency = self._connect(store, rank, size, latency_devices, self.threads)
        if self._devices == 1:
            bulk, devices = latency, len(latency_devices)
        else:
            bulk_devices = self._make_devices(self._devices)
            bulk = self._connect(dist.PrefixStore("bulk", store), rank, size, bulk_devices,
                                 self.bulk_threads_per_device * len(bulk_devices))
            devices = len(bulk_devices)
        self._bulk[latency] = (bulk, devices)
        return latency

    def shutdown(self) -> None:
        bulk_groups = [bulk for latency, (bulk, _) in self._bulk.items() if bulk is not latency]
        self._bulk.clear()
        for pg in bulk_groups:
            try:
                pg.shutdown()
            except Exception as e:  # pragma: no cover - best effort at teardown
                log.debug("bulk process group shutdown failed: %s", e)
        super().shutdown()

    def _connect(self, store: dist.Store, rank: int, size: int, devices: list[Any], threads: int) -> Any:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = self._timeout
        opts._devices = devices
        opts._threads = threads
        try:
            return dist.ProcessGroupGloo(store, rank, size, opts)
        except Exception as e:
            raise BackendError(
                f"gloo could not connect rank {rank} of {size} ({e}); check --network-interface "
                "and that every rank is running"
            ) from e

    def _make_devices(self, per_interface: int) -> list[Any]:
        """``per_interface`` gloo devices on each interface (or on this host's address).

        gloo gives collective number k the context of device k % n, so the
        allreduces a round keeps in flight travel over separate connections
        and I/O threads.
        """
        create = dist.ProcessGroupGloo.create_device
        if not self._interface:
            return [create(hostname=self._hostname or "") for _ in range(per_interface)]
        try:
            return [create(interface=n) for n in interface_names(self._interface) for _ in range(per_interface)]
        except Exception as e:
            raise BackendError(
                f"gloo cannot use network interface {self._interface!r} ({e}); pass an interface this host "
                "has (`ip -br addr`) to --network-interface / HORA_NETWORK_INTERFACE, comma-separated for several"
            ) from e


class NCCLBackend(TorchDistBackend):
    """CUDA collectives through NCCL; negotiation stays on the CPU controller."""

    name = "nccl"
    reduce_dtypes = _REDUCIBLE
    direct_threshold_bytes = 16 << 20

    def _make_pg(self, store: dist.Store, rank: int, size: int) -> Any:
        if not torch.cuda.is_available():
            raise BackendError("the NCCL backend needs CUDA, and torch.cuda.is_available() is False")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = self._timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)

    def supports_device(self, device_type: str) -> bool:
        return device_type == "cuda"

    def negotiate(self, vector: np.ndarray, poll: Callable[[float], None], spin_s: float = 200e-6) -> np.ndarray:
        raise BackendError("NCCL is a data-plane backend; negotiation runs on the CPU controller")

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        raise BackendError("NCCL is a data-plane backend; negotiation runs on the CPU controller")

    # Each collective waits for the GPU before returning, so that a finished handle means the
    # result is there (and the input free to change) on any stream, as Horovod guarantees.
    def allreduce_(self, buf: torch.Tensor, op: ReduceOp, group: Any = None) -> None:
        with self._errors():
            super().allreduce_(buf, op, group)
            torch.cuda.current_stream(buf.device).synchronize()

    def allgatherv(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int], group: Any = None) -> None:
        with self._errors():
            super().allgatherv(send, recv, counts, group)
            torch.cuda.current_stream(recv.device).synchronize()

    def broadcast_(self, buf: torch.Tensor, root: int, group: Any = None) -> None:
        with self._errors():
            super().broadcast_(buf, root, group)
            torch.cuda.current_stream(buf.device).synchronize()

    def alltoallv(
        self,
        send: torch.Tensor,
        send_counts: Sequence[int],
        recv: torch.Tensor,
        recv_counts: Sequence[int],
        group: Any = None,
    ) -> None:
        with self._errors():
            super().alltoallv(send, send_counts, recv, recv_counts, group)
            torch.cuda.current_stream(recv.device).synchronize()

    def reduce_scatterv(
        self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int], op: ReduceOp, group: Any = None
    ) -> None:
        with self._errors():
            super().reduce_scatterv(send, recv, counts, op, group)
            torch.cuda.current_stream(recv.device).synchronize()

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        """Name the fix for NCCL errors that come from how the job was set up."""
        try:
            yield
        except HoraError:
            raise
        except Exception as e:
            if "Duplicate GPU" in str(e):
                raise BackendError(
                    f"NCCL refuses to run two ranks of one job on the same GPU (rank {self.rank}: {e}). "
                    "Give each rank its own GPU, e.g. torch.cuda.set_device(hvd.local_rank()) and tensors on "
                    "f'cuda:{hvd.local_rank()}', and start at most one rank per GPU; or, to share a GPU between "
                    "ranks, move the tensors to the CPU before calling hora"
                ) from e
            raise
