"""Elastic jobs on Ray: hosts from Ray's nodes, workers as actors, hora run's elastic driver between them."""

from __future__ import annotations

import pytest

from hora.errors import ConfigError, LaunchError, UnsupportedError
from hora.ray import RayExecutor
from hora.ray.elastic import node_slots

pytestmark = pytest.mark.timeout(300)


def test_node_slots_come_from_live_nodes_and_their_resources():
    nodes = [
        {"Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 8.0, "GPU": 2.0}},
        {"Alive": False, "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 8.0}},
        {"Alive": True, "NodeManagerAddress": "10.0.0.3", "Resources": {"CPU": 1.0}},
        {"Alive": True, "NodeManagerAddress": "10.0.0.4", "Resources": {"CPU": 5.0}},
    ]
    assert node_slots(nodes, cpus_per_worker=2, gpus_per_worker=0) == {"10.0.0.1": 4, "10.0.0.4": 2}
    assert node_slots(nodes, cpus_per_worker=1, gpus_per_worker=1) == {"10.0.0.1": 2}


@pytest.mark.parametrize("kwargs, error, words", [
    ({"max_workers": 3}, ConfigError, "give min_workers too"),
    ({"min_workers": 2, "num_workers": 2}, ConfigError, "leave num_workers and num_hosts out"),
    ({"min_workers": 0}, ConfigError, "min_workers=0"),
    ({"min_workers": 3, "max_workers": 2}, ConfigError, "max_workers=2"),
    ({"min_workers": 2, "override_discovery": False}, UnsupportedError, "Ray's nodes"),
])
def test_elastic_arguments_are_checked(kwargs, error, words):
    with pytest.raises(error, match=words):
        RayExecutor(RayExecutor.create_settings(), **kwargs)


def elastic_train(steps: int) -> tuple[int, int, int]:
    """A Horovod elastic training function: hvd.elastic.run over a TorchState, committing every 5 steps."""
    import torch

    import hora.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, step=0)

    @hvd.elastic.run
    def train(state):
        while state.step < steps:
            optimizer.zero_grad()
            model(torch.randn(16, 8)).pow(2).mean().backward()
            optimizer.step()
            state.step += 1
            if state.step % 5 == 0:
                state.commit()
        return hvd.rank(), hvd.size(), state.step

    return train(state)


def test_an_elastic_job_fills_the_nodes_up_to_max_workers(cluster):
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), min_workers=2, max_workers=3,
                           elastic_timeout=120)
    with pytest.raises(LaunchError, match="call start"):
        executor.run(elastic_train, args=[20])
    executor.start()
    with pytest.raises(UnsupportedError, match="only runs functions with run"):
        executor.execute(lambda _: None)
    results = executor.run(elastic_train, args=[20])
    executor.shutdown()
    # the one local node holds 4 workers of 1 CPU; max_workers caps the job at 3
    assert results == [(0, 3, 20), (1, 3, 20), (2, 3, 20)]
