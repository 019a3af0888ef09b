"""The core's naming rules for user-named collectives (Runtime.claim_name), without an engine."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from hora.core.ops import CollectiveType
from hora.core.request import Entry, Request
from hora.core.runtime import Runtime
from hora.errors import DuplicateNameError


def request(kind: CollectiveType, name: str = "x", process_set: int = 0) -> Request:
    a = np.ones(3, np.float32)
    return Request(name, kind, [Entry(a, a)], process_set_id=process_set)


def claim(rt: Runtime, req: Request) -> Request:
    rt.claim_name(req, req.handle)
    return req


def test_same_kind_waits_until_the_program_has_seen_the_first():
    rt = Runtime(engine=None)
    first = claim(rt, request(CollectiveType.ALLREDUCE))
    first.handle.set_result([])  # finished, but nobody has waited for it
    with pytest.raises(DuplicateNameError, match="not been synchronized"):
        claim(rt, request(CollectiveType.ALLREDUCE))
    first.handle.wait()
    claim(rt, request(CollectiveType.ALLREDUCE))


def test_poll_that_says_done_frees_the_name():
    rt = Runtime(engine=None)
    first = claim(rt, request(CollectiveType.BROADCAST))
    assert not first.handle.poll()
    first.handle.set_result([])
    assert first.handle.poll()
    claim(rt, request(CollectiveType.BROADCAST))


def test_other_kind_may_reuse_a_finished_name_but_not_one_in_flight():
    rt = Runtime(engine=None)
    gather = claim(rt, request(CollectiveType.ALLGATHER))
    with pytest.raises(DuplicateNameError, match="in flight"):
        claim(rt, request(CollectiveType.ALLREDUCE))
    gather.handle.set_result([])  # finished, never waited for: Horovod lets another kind use the name
    claim(rt, request(CollectiveType.ALLREDUCE))


def test_names_are_scoped_to_their_process_set():
    rt = Runtime(engine=None)
    claim(rt, request(CollectiveType.ALLREDUCE, process_set=0))
    claim(rt, request(CollectiveType.ALLREDUCE, process_set=1))


def test_a_dropped_handle_frees_its_name():
    rt = Runtime(engine=None)
    claim(rt, request(CollectiveType.ALLREDUCE))
    gc.collect()  # the request and its handle were never kept
    claim(rt, request(CollectiveType.ALLREDUCE))
