"""Reading workers' event lines, building hora run command lines, and stopping jobs that fail or hang."""

from __future__ import annotations

import sys
import time
import uuid

import psutil
import pytest

from hora.bench.jobs import JobSpec, parse_event, run_job
from hora.errors import ConfigError, LaunchError


def test_parse_event_with_and_without_rank_prefix():
    assert parse_event('[1]<stdout>:HORA_BENCH {"event": "result", "times": {}}') == {
        "event": "result", "times": {}, "rank": 1}
    assert parse_event('HORA_BENCH {"event": "progress", "done": 1}') == {"event": "progress", "done": 1}
    # an explicit rank (e.g. the KVStore's worker rank) wins over the launcher's prefix
    assert parse_event('[0]<stdout>:HORA_BENCH {"event": "result", "rank": 3}')["rank"] == 3
    assert parse_event("[0]<stdout>:hello") is None
    assert parse_event("[0]<stdout>:HORA_BENCH {not json") is None
    assert parse_event("HORA_BENCH [1, 2]") is None


def test_command_line_passes_launcher_flags_through():
    spec = JobSpec(worker="allreduce", args=["--sizes", "4096"], num_proc=4, controller="mpi", num_servers=2,
                   hosts="a:2,b:2", run_args=["--network-interface", "eth0"])
    cmd = spec.command()
    run = cmd.index("run")
    assert cmd[run:run + 6] == ["run", "-np", "4", "--mpi", "-s", "2"]
    assert cmd[cmd.index("-H") + 1] == "a:2,b:2" and "--network-interface" in cmd
    tail = cmd[cmd.index("--") + 1:]
    assert tail[1:] == ["-m", "hora.bench.workers.allreduce", "--sizes", "4096"]
    assert "--hostfile" in JobSpec(worker="train", hostfile="hosts.txt").command()


@pytest.mark.parametrize("kwargs, match", [({"controller": "nccl"}, "backend"), ({"num_proc": 0}, "-np"),
                                           ({"timeout_s": 0}, "timeout")])
def test_bad_spec(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        JobSpec(worker="allreduce", **kwargs)


def test_failed_job_raises_with_output_tail():
    code = "import sys; print('HORA_BENCH {\"event\": \"progress\"}'); print('boom on purpose'); sys.exit(3)"
    seen = []
    with pytest.raises(LaunchError, match="exited with status") as e:
        run_job(JobSpec(worker=[sys.executable, "-c", code], num_proc=1, timeout_s=120), on_event=seen.append)
    assert "boom on purpose" in str(e.value)
    assert seen and seen[0]["event"] == "progress"


def _with_marker(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if any(marker in part for part in (p.info["cmdline"] or [])):
            found.append(p)
    return found


def test_hung_job_is_stopped_at_its_timeout_without_orphans():
    marker = f"hora-bench-hang-{uuid.uuid4().hex}"
    code = f"import time; print('HORA_BENCH {{\"event\": \"progress\"}}', flush=True); time.sleep(120)  # {marker}"
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="timeout"):
        run_job(JobSpec(worker=[sys.executable, "-c", code], num_proc=2, timeout_s=8))
    assert time.monotonic() - t0 < 40
    deadline = time.monotonic() + 10
    while _with_marker(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _with_marker(marker), "the job's processes outlived it"
