"""How the executor lays out one round's allreduces on a backend (logic only, one process).

The backend here is a recorder standing in for a 2-rank job in which both
ranks hold the same values: a finished allreduce doubles its buffer.  The
real engines run these paths in tests/parallel (gloo is concurrent, MPI not).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from hora.core.backends.base import Backend
from hora.core.executor import Executor
from hora.core.negotiation import Ready, Signature
from hora.core.ops import CollectiveType, ReduceOp
from hora.core.process_sets import ProcessSetState
from hora.core.request import Entry, Request

KiB = 1024


class Recorder(Backend):
    name = "recorder"

    def __init__(self, concurrent: bool, direct: int, bucket: int | None) -> None:
        super().__init__(0, 2)
        self.concurrent = concurrent
        self.direct_threshold_bytes = direct
        self.bucket_bytes = bucket
        self.events: list[tuple[str, int]] = []
        self.in_flight: dict[int, tuple[int, int]] = {}  # call id -> [start, end) address range
        self.most_in_flight = 0

    def allreduce_start(self, buf: torch.Tensor, op: ReduceOp, group=None, fanout: int = 1) -> Callable[[], None]:
        call = len(self.events)
        lo = buf.data_ptr()
        hi = lo + buf.numel() * buf.element_size()
        for other_lo, other_hi in self.in_flight.values():
            assert hi <= other_lo or lo >= other_hi, "two allreduces in flight share memory"
        self.in_flight[call] = (lo, hi)
        self.most_in_flight = max(self.most_in_flight, len(self.in_flight))
        self.events.append(("start", buf.numel()))

        def wait() -> None:
            buf.mul_(2)  # both ranks contributed the same values
            del self.in_flight[call]
            self.events.append(("wait", buf.numel()))

        if not self.concurrent:
            wait()
            return lambda: None
        return wait

    def allreduce_(self, buf, op, group=None):  # pragma: no cover - the executor uses allreduce_start
        raise AssertionError("allreduce_start expected")

    def negotiate(self, vector, poll, spin_s=0.0):
        return vector

    def allgather_bytes(self, data):
        return [data, data]

    def allgatherv(self, *a, **k):
        raise NotImplementedError

    def broadcast_(self, *a, **k):
        raise NotImplementedError

    def alltoallv(self, *a, **k):
        raise NotImplementedError

    def reduce_scatterv(self, *a, **k):
        raise NotImplementedError

    def new_group(self, ranks, group_id):
        return None

    def shutdown(self) -> None:
        pass


def run_round(backend: Recorder, tensors: list[torch.Tensor], fusion_bytes: int, op=ReduceOp.AVERAGE):
    """One round in which every tensor is its own ready request, reduced in place."""
    psets = {0: ProcessSetState(0, (0, 1))}
    executor = Executor(0, lambda device: backend, psets, fusion_bytes, None)
    items = []
    for i, t in enumerate(tensors):
        req = Request(f"t{i}", CollectiveType.ALLREDUCE, [Entry(t, t)], op=op)
        sig = Signature.decode(req.signature_bytes())
        items.append((Ready(req.name, 0, [sig, sig]), req))
    executor.run(items)
    return [req.handle.wait() for _, req in items]


def sizes_in_bytes(events, kind):
    return [n * 4 for what, n in events if what == kind]


def test_concurrent_backend_starts_everything_before_waiting():
    backend = Recorder(concurrent=True, direct=64 * KiB, bucket=32 * KiB)
    tensors = [torch.full((n,), float(i)) for i, n in enumerate([4096, 20000, 1000, 3000, 5000, 100])]
    expected = [t.clone() for t in tensors]  # average of two equal contributions
    run_round(backend, tensors, fusion_bytes=1 << 20)
    kinds = [what for what, _ in backend.events]
    assert kinds == ["start"] * kinds.count("start") + ["wait"] * kinds.count("wait")
    assert backend.most_in_flight == kinds.count("start") > 1
    for t, e in zip(tensors, expected, strict=True):
        torch.testing.assert_close(t, e)


def test_buckets_are_cut_at_the_backend_bucket_size():
    backend = Recorder(concurrent=True, direct=1 << 20, bucket=16 * KiB)
    tensors = [torch.ones(1024) for _ in range(10)]  # 4 KiB each: 4 per 16 KiB bucket
    run_round(backend, tensors, fusion_bytes=1 << 20)
    assert sizes_in_bytes(backend.events, "start") == [16 * KiB, 16 * KiB, 8 * KiB]
    assert all(torch.equal(t, torch.ones(1024)) for t in tensors)


def test_full_fusion_buffer_drains_what_is_in_flight_first():
    # Fusion buffer 24 KiB, buckets of 16 KiB: the second bucket does not fit beside the first.
    backend = Recorder(concurrent=True, direct=1 << 20, bucket=16 * KiB)
    tensors = [torch.full((1024,), float(i)) for i in range(8)]
    run_round(backend, tensors, fusion_bytes=24 * KiB)
    assert [what for what, _ in backend.events] == ["start", "wait", "start", "wait"]
    assert [float(t[0]) for t in tensors] == [float(i) for i in range(8)]


def test_sequential_backend_finishes_each_bucket_before_the_next():
    backend = Recorder(concurrent=False, direct=16 * KiB, bucket=None)
    tensors = [torch.full((n,), 3.0) for n in [100, 8192, 200, 300]]
    run_round(backend, tensors, fusion_bytes=1 << 20)
    kinds = [what for what, _ in backend.events]
    assert kinds == ["start", "wait"] * (len(kinds) // 2)
    assert backend.most_in_flight == 1
    assert all(torch.equal(t, torch.full_like(t, 3.0)) for t in tensors)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int16, torch.bool])
def test_upcast_dtypes_round_trip_through_the_fused_buffer(dtype):
    backend = Recorder(concurrent=True, direct=1 << 20, bucket=8 * KiB)
    values = [np.arange(n) % 3 for n in (10, 33, 7)]
    tensors = [torch.tensor(v).to(dtype) for v in values]
    outs = run_round(backend, tensors, fusion_bytes=1 << 20, op=ReduceOp.SUM)
    for t, v, out in zip(tensors, values, outs, strict=True):
        assert t.dtype == dtype
        want = torch.tensor(v * 2).to(dtype) if dtype != torch.bool else torch.tensor(v).bool()
        assert torch.equal(out[0], want)


class Timeline:
    """Records what the executor hands a timeline (the recorder's interface: Timeline.buckets)."""

    def __init__(self) -> None:
        self.records: list[list[tuple]] = []

    def buckets(self, done: list[tuple]) -> None:
        self.records.append(done)


def test_a_recorded_round_hands_its_buckets_to_the_timeline_as_one_record():
    backend = Recorder(concurrent=True, direct=16 * KiB, bucket=None)
    tensors = [torch.ones(n) for n in [100, 8192, 200]]  # 32 KiB in place; the other two fused
    psets = {0: ProcessSetState(0, (0, 1))}
    executor = Executor(0, lambda device: backend, psets, 1 << 20, None)
    executor.timeline = timeline = Timeline()
    items = []
    for i, t in enumerate(tensors):
        req = Request(f"t{i}", CollectiveType.ALLREDUCE, [Entry(t, t)], op=ReduceOp.SUM)
        sig = Signature.decode(req.signature_bytes())
        items.append((Ready(req.name, 0, [sig, sig]), req))
    executor.run(items)
    assert len(timeline.records) == 1
    (fused, direct) = timeline.records[0]
    assert fused[:3] == ("recorder", True, ["t0", "t2"]) and direct[:3] == ("recorder", False, ["t1"])
    for bucket in (fused, direct):
        assert list(bucket[3:]) == sorted(bucket[3:])  # start <= packed <= reduced <= done

    def broken(*args, **kwargs):
        raise RuntimeError("simulated transport failure")

    backend.concurrent = False
    executor.timeline = timeline = Timeline()
    started = backend.allreduce_start
    calls = []
    backend.allreduce_start = lambda *a, **k: (calls.append(1), (started if len(calls) == 1 else broken)(*a, **k))[1]
    with pytest.raises(RuntimeError, match="simulated"):
        executor.run([(ready, Request(ready.name, CollectiveType.ALLREDUCE, [Entry(t, t)], op=ReduceOp.SUM))
                      for (ready, _), t in zip(items, tensors, strict=True)])
    assert [[b[2] for b in record] for record in timeline.records] == [[["t0", "t2"]]]  # what finished, still
