"""A backend that raises mid-collective fails the waiting call instead of leaving it hanging."""

from __future__ import annotations

import threading

import pytest
import torch

import hora.torch as hvd
from hora.core import runtime
from hora.errors import InternalError


def test_backend_exception_reaches_the_caller():
    hvd.init()
    try:
        engine = runtime.current().engine
        backend = engine._backend_for("cpu")

        def broken(*args, **kwargs):
            raise RuntimeError("simulated transport failure")

        backend.allreduce_ = broken  # instance attributes: only this engine's backend
        backend.allreduce_start = broken
        outcome: list[BaseException] = []

        def call() -> None:
            try:
                hvd.allreduce(torch.ones(3), name="failing")
            except BaseException as e:  # noqa: BLE001 - handed to the test thread
                outcome.append(e)

        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        caller.join(30)
        assert not caller.is_alive(), "allreduce hung after its backend raised"
        assert len(outcome) == 1 and isinstance(outcome[0], InternalError), outcome
        assert "simulated transport failure" in str(outcome[0])
        with pytest.raises(InternalError):  # the engine stopped: later calls fail at once
            hvd.allreduce(torch.ones(3), name="after")
    finally:
        hvd.shutdown()
    hvd.init()  # and hora starts again afterwards
    try:
        assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [1.0, 1.0]
    finally:
        hvd.shutdown()
