"""One local Ray instance for the tests here (Ray takes seconds to start); all skipped without Ray."""

from __future__ import annotations

import types

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'hora[ray]' (./dev setup installs it)")
if not hasattr(ray, "init"):  # without Ray, 'import ray' can find this very directory as a namespace package
    pytest.skip("Ray is not installed: pip install 'hora[ray]' (./dev setup installs it)", allow_module_level=True)

#: Small on purpose: the test machine's cores are shared.  cpus_per_worker=1 leaves room for 3 workers
#: and one more actor.
NUM_CPUS = 4


@pytest.fixture(scope="session")
def ray_local():
    """A new local Ray instance with no dashboard (address="local": never a cluster left running here)."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=NUM_CPUS, include_dashboard=False, log_to_driver=True)
    yield ray
    ray.shutdown()


@pytest.fixture(autouse=True)
def _functions_by_value(request):
    """The actors cannot import test modules: ship a test module's functions and classes by value."""
    ray.cloudpickle.register_pickle_by_value(request.module)


def live_actors() -> list[dict]:
    """The actors Ray's control store (GCS) does not list as dead.

    ``ray.util.state.list_actors`` asks the dashboard's API server, which a
    Ray started without the dashboard does not run; the GCS actor table it
    serves is read here directly.
    """
    from ray._private import state

    return [a for a in state.actors().values() if a["State"] != "DEAD"]


def live_placement_groups() -> list[str]:
    """Placement groups that are not removed."""
    return [pg for pg, info in ray.util.placement_group_table().items() if info["state"] != "REMOVED"]


@pytest.fixture
def cluster(ray_local):
    """The shared Ray instance; the test starts and must end with no live actor and no placement group."""
    assert not live_actors(), f"a test before this one left actors: {live_actors()}"
    yield types.SimpleNamespace(ray=ray_local, live_actors=live_actors, live_placement_groups=live_placement_groups)
    assert not live_actors(), f"actors left behind: {live_actors()}"
    assert not live_placement_groups(), f"placement groups left behind: {live_placement_groups()}"
