"""hora's gloo backend on one process: devices, splitting, and the error for a bad interface."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hora.core.backends.torch_dist import GlooBackend
from hora.core.ops import ReduceOp
from hora.errors import BackendError


def make(**kwargs) -> GlooBackend:
    return GlooBackend(dist.HashStore(), 0, 1, prefix="t", timeout_s=10, hostname="127.0.0.1", **kwargs)


def test_latency_and_bulk_groups():
    backend = make(devices=3)
    try:
        bulk, devices = backend._bulk[backend.pg]
        assert bulk is not backend.pg and devices == 3
    finally:
        backend.shutdown()
    backend = make(devices=1)
    try:
        assert backend._bulk[backend.pg] == (backend.pg, 1)
    finally:
        backend.shutdown()


def test_large_tensor_is_reduced_in_pieces_in_place():
    backend = make(devices=4)
    try:
        split = backend.split_bytes // 4  # float32 elements per split_bytes
        calls = []
        real = backend._allreduce_on
        bulk = backend._bulk[backend.pg][0]

        def recording(pg, buf, op):
            calls.append((buf.data_ptr(), buf.numel(), "bulk" if pg is bulk else "latency"))
            return real(pg, buf, op)

        backend._allreduce_on = recording
        t = torch.arange(3 * split + 5, dtype=torch.float32)
        backend.allreduce_(t, ReduceOp.SUM)
        assert len(calls) == 3  # three whole split_bytes: three pieces, fewer than the four devices
        assert sum(n for _, n, _ in calls) == t.numel() and calls[0][0] == t.data_ptr()
        assert {where for *_, where in calls} == {"bulk"}
        assert torch.equal(t, torch.arange(3 * split + 5, dtype=torch.float32))
        calls.clear()
        one_piece = torch.ones(split)
        backend.allreduce_start(one_piece, ReduceOp.SUM, fanout=backend.bulk_fanout)()  # a busy round: bulk
        backend.allreduce_start(one_piece, ReduceOp.SUM, fanout=backend.bulk_fanout - 1)()  # a quiet one: latency
        backend.allreduce_start(torch.ones(1000), ReduceOp.SUM, fanout=100)()  # small: always latency
        assert [where for *_, where in calls] == ["bulk", "latency", "latency"]
    finally:
        backend.shutdown()


def test_unknown_interface_names_it():
    with pytest.raises(BackendError, match=r"network interface 'nope0'.*--network-interface"):
        GlooBackend(dist.HashStore(), 0, 1, prefix="t", timeout_s=10, interface="nope0")
