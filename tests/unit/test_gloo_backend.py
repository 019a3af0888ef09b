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


def test_one_device_per_connection_asked_for():
    backend = make(devices=3)
    try:
        assert len(backend._device_list) == 3
    finally:
        backend.shutdown()


def test_large_tensor_is_reduced_in_pieces_in_place():
    backend = make(devices=4)
    try:
        split = backend.split_bytes // 4  # float32 elements per split_bytes
        calls = []
        real = backend._allreduce_work

        def recording(buf, op, group):
            calls.append((buf.data_ptr(), buf.numel()))
            return real(buf, op, group)

        backend._allreduce_work = recording
        t = torch.arange(3 * split + 5, dtype=torch.float32)
        backend.allreduce_(t, ReduceOp.SUM)
        assert len(calls) == 3  # three whole split_bytes: three pieces, fewer than the four devices
        assert sum(n for _, n in calls) == t.numel() and calls[0][0] == t.data_ptr()
        assert torch.equal(t, torch.arange(3 * split + 5, dtype=torch.float32))
        calls.clear()
        backend.allreduce_(torch.ones(split), ReduceOp.SUM)
        assert len(calls) == 1
    finally:
        backend.shutdown()


def test_unknown_interface_names_it():
    with pytest.raises(BackendError, match=r"network interface 'nope0'.*--network-interface"):
        GlooBackend(dist.HashStore(), 0, 1, prefix="t", timeout_s=10, interface="nope0")
