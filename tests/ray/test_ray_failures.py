"""A rank that raises or is SIGKILLed: a clear error on the driver naming it, and nothing left in the cluster."""

from __future__ import annotations

import time

import pytest

from hora.errors import ActorFailedError, LaunchError
from hora.ray import RayExecutor

pytestmark = pytest.mark.timeout(240)


def executor_of(num_workers: int) -> RayExecutor:
    return RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=num_workers)


def train_until(failing_rank: int, how: str) -> None:
    """Every rank trains; after a few steps ``failing_rank`` raises or SIGKILLs itself, the others go on."""
    import os
    import signal

    import torch

    import hora.torch as hvd

    hvd.init()
    for step in range(100_000):
        if step == 5 and hvd.rank() == failing_rank:
            if how == "raise":
                raise ValueError(f"boom on rank {hvd.rank()}")
            os.kill(os.getpid(), signal.SIGKILL)
        hvd.allreduce(torch.ones(1000), name=f"grad.{step}")


def node_ip(ray) -> str:
    return ray.util.get_node_ip_address()


@pytest.mark.parametrize("num_workers", [2, 3])
def test_a_rank_that_raises_names_itself_and_stops_the_job(cluster, num_workers):
    executor = executor_of(num_workers)
    executor.start()
    actor_id = executor.workers[1]._actor_id.hex()
    started = time.monotonic()
    with pytest.raises(ActorFailedError) as caught:
        executor.run(train_until, args=[1, "raise"])
    assert time.monotonic() - started < 60
    error = caught.value
    assert (error.rank, error.actor, error.node) == (1, actor_id, node_ip(cluster.ray))
    assert isinstance(error.__cause__, ValueError) and "boom on rank 1" in str(error.__cause__)
    message = str(error)
    assert f"rank 1 (Ray actor {actor_id} on node {node_ip(cluster.ray)}) raised ValueError: boom on rank 1" in message
    assert "every worker actor of the job was stopped" in message
    assert not cluster.live_actors()  # checked again by the fixture, with the placement groups
    with pytest.raises(LaunchError, match="call start"):
        executor.run(train_until, args=[1, "raise"])


def test_a_sigkilled_rank_is_the_root_cause_not_its_peers_broken_collectives(cluster):
    executor = executor_of(3)
    executor.start()
    actor_id = executor.workers[2]._actor_id.hex()
    started = time.monotonic()
    with pytest.raises(ActorFailedError) as caught:
        executor.run(train_until, args=[2, "sigkill"])
    assert time.monotonic() - started < 60
    error = caught.value
    assert (error.rank, error.actor, error.node) == (2, actor_id, node_ip(cluster.ray))
    assert str(error).startswith(f"rank 2 (Ray actor {actor_id} on node {node_ip(cluster.ray)}) died: ")
    assert "worker process has died" in str(error)
    assert not cluster.live_actors()


class Broken:
    def __init__(self) -> None:
        raise RuntimeError("cannot build the model")


def test_an_executable_that_fails_to_start_fails_start(cluster):
    executor = executor_of(2)
    with pytest.raises(ActorFailedError, match="raised RuntimeError: cannot build the model.*creating the executable"):
        executor.start(executable_cls=Broken)
    assert executor.workers == []
    assert not cluster.live_actors()
