"""RayExecutor on a local Ray instance: results per rank, training, executables, run_remote, placement groups."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hora import envvars
from hora.errors import ConfigError, PlacementTimeoutError
from hora.ray import RayExecutor

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "torch"
pytestmark = pytest.mark.timeout(240)


def settings(**kwargs):
    return RayExecutor.create_settings(timeout_s=60, placement_group_timeout_s=30, **kwargs)


def whoami(scale: int) -> dict:
    import torch

    import hora.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum, name="whoami")
    return {
        "rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
        "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(), "sum": float(total),
        "scaled": hvd.rank() * scale,
        "env": {k: v for k, v in os.environ.items() if k.startswith(("HORA_", "HOROVOD_", "OMP_", "MY_"))},
        "pid": os.getpid(), "nice": os.getpriority(os.PRIO_PROCESS, 0),
    }


@pytest.mark.parametrize("num_workers", [2, 3])
def test_run_returns_every_ranks_result_in_rank_order(cluster, num_workers):
    with RayExecutor(settings(), num_workers=num_workers, cpus_per_worker=1) as executor:
        executor.start(extra_env_vars={"MY_VAR": "from-driver"})
        assert executor.start_timings["total"] <= 10, executor.start_timings
        results = executor.run(whoami, args=[10])
        assert [r["rank"] for r in results] == list(range(num_workers))
        assert [r["scaled"] for r in results] == [10 * r for r in range(num_workers)]
        assert {r["sum"] for r in results} == {num_workers * (num_workers + 1) / 2}
        assert len({r["pid"] for r in results}) == num_workers
        for r in results:
            # one node: every rank is local, one host
            assert (r["size"], r["local_rank"], r["local_size"], r["cross_rank"], r["cross_size"]) == (
                num_workers, r["rank"], num_workers, 0, 1)
            env = r["env"]
            assert env[envvars.HORA_CONTROLLER] == "gloo" and len(env[envvars.HORA_SECRET]) == 32
            assert env[envvars.HOROVOD_PLACEMENT[0]] == str(r["rank"])
            assert env[envvars.OMP_NUM_THREADS] == "1" and env["MY_VAR"] == "from-driver"
        assert len({r["env"][envvars.HORA_SECRET] for r in results}) == 1
        if os.geteuid() == 0:  # may lower its niceness: the workers left Ray's nice 15 for worker_niceness=0
            assert {r["nice"] for r in results} == {0}
        # a second function in the same actors: the engine is already up
        assert executor.run(lambda: __import__("hora.torch").torch.rank()) == list(range(num_workers))
    assert executor.workers == []


def engine_cycle(i: int) -> dict:
    """Start hora, reduce once, shut it down; then the process's torch and hora threads, by name."""
    import torch

    import hora.torch as hvd

    hvd.init()
    hvd.allreduce(torch.ones(4), name=f"cycle.{i}")
    hvd.shutdown()
    names: dict[str, int] = {}
    for tid in os.listdir(f"/proc/{os.getpid()}/task"):
        with open(f"/proc/{os.getpid()}/task/{tid}/comm") as f:
            name = f.read().strip()
        if name.startswith(("pt_", "hora")):
            names[name] = names.get(name, 0) + 1
    return names


def test_reused_actors_keep_no_threads_from_earlier_engines(cluster):
    """Each init()/shutdown() in the same actors releases its gloo group: no run loops pile up across runs."""
    with RayExecutor(settings(), num_workers=2, cpus_per_worker=1) as executor:
        executor.start()
        first = executor.run(engine_cycle, args=[0])
        for i in range(1, 4):
            later = executor.run(engine_cycle, args=[i])
        assert later == first, f"threads after 4 engines {later}, after 1 {first}"
        assert not any(name.startswith("hora") for r in later for name in r), later


def test_hosts_form_places_workers_per_host(cluster):
    executor = RayExecutor(settings(), num_hosts=1, num_workers_per_host=3)
    executor.start()
    try:
        results = executor.run(whoami, kwargs={"scale": 1})
        assert [(r["rank"], r["local_rank"], r["local_size"], r["cross_size"]) for r in results] == [
            (0, 0, 3, 1), (1, 1, 3, 1), (2, 2, 3, 1)]
    finally:
        executor.shutdown()
    executor.shutdown()  # twice is fine


def train_digits(example_dir: str, checkpoint_dir: str) -> tuple[int, float]:
    """examples/torch/train_digits.py's main, unchanged, on this rank; returns its status and test accuracy."""
    import sys

    sys.path.insert(0, example_dir)
    import train_digits as example

    accuracies = []
    evaluate = example.evaluate

    def recording(*args, **kwargs):
        accuracies.append(evaluate(*args, **kwargs))
        return accuracies[-1]

    example.evaluate = recording
    status = example.main(["--no-progress", "--min-accuracy", "0.95", "--checkpoint-dir", checkpoint_dir])
    return status, accuracies[-1]


def test_training_the_digits_example_reaches_its_accuracy(cluster, tmp_path):
    executor = RayExecutor(settings(), num_workers=2)
    executor.start()
    try:
        results = executor.run(train_digits, args=[str(EXAMPLES), str(tmp_path)])
    finally:
        executor.shutdown()
    (status0, acc0), (status1, acc1) = results
    assert status0 == status1 == 0
    assert acc0 == acc1 >= 0.95  # the accuracy is allreduced: every rank reports the same


class Counter:
    """An executable: made once per actor after hvd.init's environment is set, kept across calls."""

    def __init__(self, start: int) -> None:
        import hora.torch as hvd

        hvd.init()
        self.hvd = hvd
        self.count = start

    def bump(self) -> tuple[int, int]:
        self.count += 1
        return self.hvd.rank(), self.count


def test_executable_holds_state_across_execute_calls(cluster):
    executor = RayExecutor(settings(), num_workers=2)
    executor.start(executable_cls=Counter, executable_args=[10])
    try:
        assert executor.execute(lambda c: c.bump()) == [(0, 11), (1, 11)]
        assert executor.execute(lambda c: c.bump()) == [(0, 12), (1, 12)]
        assert executor.execute_single(lambda c: c.bump()) == (0, 13)
        assert executor.execute(lambda c: c.count) == [13, 12]
    finally:
        executor.shutdown()


def test_run_remote_returns_object_refs(cluster):
    executor = RayExecutor(settings(), num_workers=3)
    executor.start()
    try:
        refs = executor.run_remote(whoami, args=[2])
        assert len(refs) == 3 and all(isinstance(ref, cluster.ray.ObjectRef) for ref in refs)
        assert [r["scaled"] for r in cluster.ray.get(refs, timeout=120)] == [0, 2, 4]
    finally:
        executor.shutdown()


def test_runs_inside_an_existing_placement_group(cluster):
    ray = cluster.ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = ray.util.placement_group([{"CPU": 1}, {"CPU": 1}], strategy="PACK")
    ray.get(group.ready(), timeout=60)

    @ray.remote(num_cpus=0)
    class Trial:
        def run(self):
            executor = RayExecutor(settings(), num_workers=2)
            executor.start()
            try:
                return executor.created_placement_group, [r["rank"] for r in executor.run(whoami, args=[1])]
            finally:
                executor.shutdown()

    trial = Trial.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=group, placement_group_capture_child_tasks=True)).remote()
    try:
        created, ranks = ray.get(trial.run.remote(), timeout=180)
    finally:
        ray.kill(trial)
        ray.util.remove_placement_group(group)
    assert created is False  # the workers took the trial's bundles
    assert ranks == [0, 1]


def test_a_placement_the_cluster_cannot_hold_times_out_clearly(cluster):
    executor = RayExecutor(RayExecutor.create_settings(placement_group_timeout_s=2), num_workers=5)
    with pytest.raises(PlacementTimeoutError, match="placement_group_timeout_s=2") as caught:
        executor.start()
    assert isinstance(caught.value, TimeoutError)  # what Horovod raised
    executor.shutdown()


def test_mpi_is_refused_before_anything_starts(cluster):
    executor = RayExecutor(settings(), num_workers=2)
    refusal = r"HOROVOD_CONTROLLER='mpi' in extra_env_vars: hora.ray runs its workers as Ray actors.*set it to 'gloo'"
    with pytest.raises(ConfigError, match=refusal):
        executor.start(extra_env_vars={"HOROVOD_CONTROLLER": "mpi"})
    assert not cluster.live_placement_groups()
