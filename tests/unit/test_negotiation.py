"""Negotiation bookkeeping, simulated for several ranks in one process."""

from __future__ import annotations

import numpy as np
import pytest

from hora.core.negotiation import HEADER, NameCache, Signature, resolve, validate
from hora.core.ops import CollectiveType, ReduceOp
from hora.errors import MismatchError


def sig(shape=(4,), dtype="float32", kind=CollectiveType.ALLREDUCE, op=ReduceOp.SUM, root=-1, pset=0):
    return Signature(kind, ((dtype, tuple(shape), ()),), op, root, 1.0, 1.0, pset, "cpu")


def simulate_round(caches, pending, joined=(), members=None):
    """Run one negotiation round for len(caches) ranks; pending[r] maps name -> Signature."""
    world = len(caches)
    members = members or {0: tuple(range(world))}
    vectors, announcements = [], []
    for r, cache in enumerate(caches):
        vec = np.zeros(HEADER + len(cache), np.int64)
        ann = {}
        for name, s in pending[r].items():
            slot = cache.lookup(name, s.encode(), r)
            if slot is None:
                ann[name] = s.encode()
            else:
                vec[HEADER + slot] = 1
        if r in joined:
            for e in cache.by_id:
                vec[HEADER + e.id] = 1
        vec[0] = int(bool(ann) or r in joined)
        vectors.append(vec)
        announcements.append(ann)
    assert len({len(v) for v in vectors}) == 1, "caches diverged: vectors have different lengths"
    totals = np.sum(vectors, axis=0)
    anns = announcements if totals[0] > 0 else None
    return [resolve(c, totals, anns, set(joined), members, world) for c in caches]


def test_new_name_is_announced_then_cached():
    caches = [NameCache(16) for _ in range(3)]
    pending = [{"grad.w": sig()} for _ in range(3)]
    results = simulate_round(caches, pending)
    assert all([x.name for x in res] == ["grad.w"] for res in results)
    assert all(len(c) == 1 for c in caches)
    # second time: found in the cache, no announcement needed
    assert caches[0].lookup("grad.w", sig().encode(), 0) == 0
    results = simulate_round(caches, pending)
    assert [x.name for x in results[1]] == ["grad.w"]


def test_not_ready_until_every_rank_submits():
    caches = [NameCache(16) for _ in range(2)]
    results = simulate_round(caches, [{"a": sig()}, {}])
    assert results == [[], []]
    results = simulate_round(caches, [{"a": sig()}, {"a": sig()}])
    assert [x.name for x in results[0]] == ["a"]


def test_order_is_identical_on_all_ranks():
    caches = [NameCache(16) for _ in range(2)]
    names = ["z", "a", "m"]
    simulate_round(caches, [{n: sig() for n in names}] * 2)
    results = simulate_round(caches, [{n: sig() for n in reversed(names)}, {n: sig() for n in names}])
    assert [x.name for x in results[0]] == [x.name for x in results[1]]


def test_shape_mismatch_reported_on_every_rank():
    caches = [NameCache(16) for _ in range(2)]
    results = simulate_round(caches, [{"t": sig((2,))}, {"t": sig((3,))}])
    for res in results:
        assert isinstance(res[0].error, MismatchError)
        assert "rank 0: (2,)" in str(res[0].error) and "rank 1: (3,)" in str(res[0].error)
    assert all(len(c) == 0 for c in caches), "a mismatched request must not be cached"


def test_changed_signature_of_cached_name_is_revalidated():
    caches = [NameCache(16) for _ in range(2)]
    simulate_round(caches, [{"t": sig((2,))}] * 2)
    results = simulate_round(caches, [{"t": sig((2,))}, {"t": sig((5,))}])
    assert results[0][0].error is not None


def test_allgather_first_dim_may_differ():
    s0 = sig((2, 3), kind=CollectiveType.ALLGATHER)
    s1 = sig((5, 3), kind=CollectiveType.ALLGATHER)
    assert validate("g", [s0, s1]) is None
    assert validate("g", [s0, sig((5, 4), kind=CollectiveType.ALLGATHER)]) is not None


@pytest.mark.parametrize(
    ("a", "b", "field"),
    [
        (sig(dtype="float32"), sig(dtype="int64"), "dtype"),
        (sig(op=ReduceOp.SUM), sig(op=ReduceOp.MAX), "op"),
        (sig(kind=CollectiveType.BROADCAST, root=0), sig(kind=CollectiveType.BROADCAST, root=1), "root"),
        (sig(), sig(kind=CollectiveType.ALLGATHER), "operation"),
    ],
)
def test_validate_names_the_field(a, b, field):
    err = validate("x", [a, b])
    assert err is not None and field in str(err)


def test_joined_rank_counts_as_ready():
    caches = [NameCache(16) for _ in range(2)]
    simulate_round(caches, [{"g": sig()}] * 2)
    results = simulate_round(caches, [{"g": sig()}, {}], joined=(1,))
    assert [x.name for x in results[0]] == ["g"]
    assert results[0][0].signatures[1] is None  # the joined rank contributes zeros


def test_nothing_ready_when_all_joined():
    caches = [NameCache(16) for _ in range(2)]
    simulate_round(caches, [{"g": sig()}] * 2)
    assert simulate_round(caches, [{}, {}], joined=(0, 1)) == [[], []]


def test_process_set_readiness_counts_members_only():
    caches = [NameCache(16) for _ in range(3)]
    members = {0: (0, 1, 2), 1: (0, 2)}
    pending = [{"p": sig(pset=1)}, {}, {"p": sig(pset=1)}]
    results = simulate_round(caches, pending, members=members)
    assert [x.name for x in results[1]] == ["p"]  # non-members know it ran, and skip it


def test_noname_requests_are_not_cached():
    caches = [NameCache(16) for _ in range(2)]
    simulate_round(caches, [{"allreduce.noname.3": sig()}] * 2)
    assert len(caches[0]) == 0


def test_cache_capacity_is_respected():
    caches = [NameCache(2) for _ in range(2)]
    simulate_round(caches, [{n: sig() for n in "abc"}] * 2)
    assert len(caches[0]) == 2
    results = simulate_round(caches, [{n: sig() for n in "abc"}] * 2)
    assert sorted(x.name for x in results[0]) == ["a", "b", "c"]


def test_signature_roundtrip():
    s = sig((2, 3), dtype="bfloat16", op=ReduceOp.AVERAGE)
    assert Signature.decode(s.encode()) == s
