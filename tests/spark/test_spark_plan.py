"""hora.spark's pure decisions: ranks from the barrier tasks' reports, GPUs, slot checks, the ranks' environment."""

from __future__ import annotations

import pytest

from hora import envvars
from hora.errors import ConfigError, RankFailedError
from hora.spark.plan import (
    TaskInfo,
    check_slots,
    choose_controller,
    job_env,
    last_traceback,
    plan_ranks,
    rank_env,
    rendezvous,
    spark_error_summary,
    visible_devices,
)

pytestmark = [pytest.mark.spark, pytest.mark.timeout(60)]


def _info(partition: int, host: str, gpus: tuple[str, ...] = (), port: int = 1000) -> TaskInfo:
    return TaskInfo(partition=partition, host=host, addr=host, port=port + partition, gpus=gpus)


def test_ranks_are_consecutive_per_host_in_host_address_order():
    # partitions interleave the hosts; ranks must not
    infos = [_info(0, "10.0.0.9"), _info(1, "10.0.0.2"), _info(2, "10.0.0.9"), _info(3, "10.0.0.2"),
             _info(4, "10.0.0.9")]
    slots = plan_ranks(infos)
    assert [s.rank for s in slots] == [2, 0, 3, 1, 4]
    assert [s.host for s in slots] == [i.host for i in infos]
    assert [(s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots] == [
        (0, 3, 1, 2), (0, 2, 0, 2), (1, 3, 1, 2), (1, 2, 0, 2), (2, 3, 1, 2)]
    assert {s.size for s in slots} == {5}
    # 10.0.0.10 sorts after 10.0.0.9 by address, not as text
    assert [s.rank for s in plan_ranks([_info(0, "10.0.0.10"), _info(1, "10.0.0.9")])] == [1, 0]


def test_local_ranks_follow_the_gpus_and_each_rank_sees_its_own_first():
    infos = [_info(0, "h", ("3",)), _info(1, "h", ("1",)), _info(2, "g", ("0",)), _info(3, "h", ("2",))]
    slots = plan_ranks(infos)
    assert [(s.rank, s.local_rank) for s in slots] == [(3, 2), (1, 0), (0, 0), (2, 1)]
    for index, slot in enumerate(slots):
        devices = visible_devices(infos, slots, index).split(",")
        assert devices[slot.local_rank] == infos[index].gpus[0]  # set_device(local_rank) finds its own GPU
    assert visible_devices(infos, slots, 0) == "1,2,3"
    assert visible_devices(infos, slots, 2) == "0"


def test_several_gpus_per_task_put_every_task_first_gpu_first():
    infos = [_info(0, "h", ("2", "3")), _info(1, "h", ("0", "1"))]
    slots = plan_ranks(infos)
    assert [s.local_rank for s in slots] == [1, 0]
    assert visible_devices(infos, slots, 0) == "0,2,1,3"
    assert visible_devices(infos, slots, 1) == "0,2,1,3"


def test_tasks_sharing_a_gpu_each_see_only_their_own():
    infos = [_info(0, "h", ("0",)), _info(1, "h", ("0",))]
    slots = plan_ranks(infos)
    assert [visible_devices(infos, slots, i) for i in range(2)] == ["0", "0"]


def test_no_gpus_means_no_cuda_visible_devices_and_mixed_gpus_are_refused():
    infos = [_info(0, "h"), _info(1, "h")]
    assert visible_devices(infos, plan_ranks(infos), 0) is None
    mixed = [_info(0, "h", ("0",)), _info(1, "h")]
    with pytest.raises(ConfigError, match="same spark.task.resource.gpu.amount"):
        visible_devices(mixed, plan_ranks(mixed), 0)


def test_rank_zero_task_hosts_the_rendezvous_and_every_rank_gets_the_job_env():
    infos = [_info(0, "10.0.0.9", port=5000), _info(1, "10.0.0.2", port=6000)]
    slots = plan_ranks(infos)
    assert rendezvous(infos, slots) == ("10.0.0.2", 6001)
    job = job_env(num_proc=2, start_timeout=12, nics=None, env={"MY_VAR": "1"})
    assert job[envvars.HORA_CONTROLLER] == "gloo"
    assert job[envvars.HORA_START_TIMEOUT] == "12"
    assert job["MY_VAR"] == "1"
    assert len(job[envvars.HORA_SECRET]) == 32
    assert envvars.OMP_NUM_THREADS not in job  # the task's own (spark.task.cpus) stays
    env = rank_env(job, slots[0], rendezvous(infos, slots), "1")
    assert env[envvars.HORA_RANK] == "1" and env[envvars.HORA_SIZE] == "2"
    assert env[envvars.HORA_RENDEZVOUS_ADDR] == "10.0.0.2" and env[envvars.HORA_RENDEZVOUS_PORT] == "6001"
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    assert job_env(num_proc=2, start_timeout=None, nics=None, env={"OMP_NUM_THREADS": "3"})["OMP_NUM_THREADS"] == "3"
    nic = job_env(num_proc=2, start_timeout=None, nics=("eth1", "eth0"), env={})
    assert nic[envvars.GLOO_SOCKET_IFNAME] == "eth1,eth0"


def test_too_many_ranks_names_both_numbers():
    check_slots(2, 2, "x")
    with pytest.raises(ConfigError, match=r"num_proc=3 .* task slots: 2 \(2 executors"):
        check_slots(3, 2, "2 executors registered")


def test_the_engine_is_gloo_unless_mpi_is_asked_by_flag_or_variable():
    assert choose_controller(None, None, {}, {}) == "gloo"
    assert choose_controller(True, None, {}, {}) == "mpi"
    assert choose_controller(None, None, {"HORA_CONTROLLER": "mpi"}, {}) == "mpi"
    assert choose_controller(None, None, {}, {"HOROVOD_CONTROLLER": "MPI"}) == "mpi"
    # the flags win over the variables; the job's env over the driver's
    assert choose_controller(None, True, {"HORA_CONTROLLER": "mpi"}, {}) == "gloo"
    assert choose_controller(False, None, {}, {"HORA_CONTROLLER": "mpi"}) == "gloo"
    assert choose_controller(None, None, {"HORA_CONTROLLER": "gloo"}, {"HORA_CONTROLLER": "mpi"}) == "gloo"
    with pytest.raises(ConfigError, match="use_mpi=True and use_gloo=True contradict"):
        choose_controller(True, True, {}, {})
    with pytest.raises(ConfigError, match="HOROVOD_CONTROLLER='nccl' in the driver's environment"):
        choose_controller(None, None, {}, {"HOROVOD_CONTROLLER": "nccl"})


def test_task_info_survives_the_exchange():
    info = TaskInfo(partition=3, host="h", addr="10.0.0.1", port=99, gpus=("0", "1"), rows=7)
    assert TaskInfo.from_dict(info.to_dict()) == info


def test_tracebacks_and_spark_errors_are_summarized():
    lines = ["noise", "Traceback (most recent call last):", '  File "x", line 1', "ValueError: first",
             "more noise", "Traceback (most recent call last):", '  File "y", line 2', "KeyError: 'k'"]
    assert last_traceback(lines) == "\n".join(lines[5:])
    assert last_traceback(["no traceback here"]) == ""
    text = ("An error occurred while calling o93.collectAsArrowToPython.\n"
            ": org.apache.spark.SparkException: Job aborted due to stage failure: boom\n\tat org.apache.X")
    assert spark_error_summary(text) == "Job aborted due to stage failure: boom"
    python = ("An error occurred while calling o1.collectAndServe.\n: org.apache.spark.SparkException: Job aborted "
              "due to stage failure: barrier task failed.\norg.apache.spark.api.python.PythonException: Traceback "
              "(most recent call last):\n  File \"worker.py\", line 1, in main\nModuleNotFoundError: No module "
              "named 'hora'\n\n\tat org.apache.spark.api.python.BasePythonRunner.handlePythonException")
    assert spark_error_summary(python) == ("Job aborted due to stage failure: barrier task failed.; a task's Python "
                                           "error: ModuleNotFoundError: No module named 'hora'")


def test_rank_failed_error_shows_the_traceback_and_pickles():
    import pickle

    error = RankFailedError(1, 1, "h", "tail", "Traceback (most recent call last):\nValueError: boom")
    assert "rank 1 on h" in str(error) and "ValueError: boom" in str(error)
    again = pickle.loads(pickle.dumps(error))
    assert (again.rank, again.traceback, str(again)) == (1, error.traceback, str(error))
