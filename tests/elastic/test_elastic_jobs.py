"""Elastic jobs on local processes: localhost and 127.0.0.1 act as two hosts (Horovod's elastic scenarios)."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).parent / "scripts" / "elastic_train.py"
JOB_TIMEOUT = 540


def discovery_script(tmp_path: Path, schedule: dict[int | None, list[str]]) -> tuple[Path, Path]:
    """A discovery script printing the hosts of the epoch that rank 0 last wrote to the epoch file."""
    epoch_file = tmp_path / "epoch"
    lines = ["#!/bin/sh", f'epoch=$(cat "{epoch_file}" 2>/dev/null || echo 0)', 'case "$epoch" in']
    for epoch, hosts in schedule.items():
        pattern = "*" if epoch is None else str(epoch)
        lines.append(f"  {pattern}) " + "; ".join(f"echo {h}" for h in hosts) + " ;;")
    lines.append("esac")
    script = tmp_path / "discover.sh"
    script.write_text("\n".join(lines) + "\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script, epoch_file


def run_elastic(run_job, tmp_path, *, np=2, min_np=2, max_np=4, hosts=None, schedule=None, extra=(), **script_args):
    log = tmp_path / "log.jsonl"
    weights = tmp_path / "weights.jsonl"
    args = ["--min-np", str(min_np), "--max-np", str(max_np), *extra]
    command = [sys.executable, str(SCRIPT), "--logfile", str(log), "--weights-file", str(weights)]
    if schedule is not None:
        script, epoch_file = discovery_script(tmp_path, schedule)
        args += ["--host-discovery-script", str(script)]
        command += ["--epoch-file", str(epoch_file)]
    if hosts is not None:
        args += ["-H", hosts]
    for name, value in script_args.items():
        command += [f"--{name.replace('_', '-')}", value if isinstance(value, str) else json.dumps(value)]
    proc = run_job(np, command, extra_args=args, timeout=JOB_TIMEOUT)
    results = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    digests = [json.loads(line) for line in weights.read_text().splitlines()] if weights.exists() else []
    return proc, results, digests


def assert_same_weights(digests, size):
    assert len(digests) == size, digests
    assert len({d["digest"] for d in digests}) == 1, digests


@pytest.mark.parametrize("wait_mode", ["commit", "notification"])
def test_hosts_added_then_removed(run_job, tmp_path, wait_mode):
    """The driver's notification reaches the state's host messages (what Horovod's own scenario script waits
    for) and the next commit re-forms the ring, on every rank at once."""
    schedule = {0: ["localhost:2"], 1: ["localhost:2", "127.0.0.1:2"], None: ["127.0.0.1:2"]}
    proc, results, digests = run_elastic(run_job, tmp_path, schedule=schedule, wait_for_hosts="0,1",
                                         wait_mode=wait_mode, extra=["--reset-limit", "2"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [(r["size"], r["hostname"], r["start_rank"], r["rendezvous"]) for r in results] == [
        (2, "localhost", 0, 1), (4, "localhost", 0, 2), (2, "127.0.0.1", 2, 3)]
    assert_same_weights(digests, 2)


def test_reset_limit_exceeded_fails_the_job(run_job, tmp_path):
    schedule = {0: ["localhost:2"], 1: ["localhost:2", "127.0.0.1:2"], None: ["127.0.0.1:2"]}
    proc, results, _ = run_elastic(run_job, tmp_path, schedule=schedule, wait_for_hosts="0,1",
                                   extra=["--reset-limit", "1"])
    assert proc.returncode != 0
    assert "more than --reset-limit 1" in proc.stderr
    assert [r["size"] for r in results] == [2, 4]


@pytest.mark.parametrize("fixed,mode", [(False, "exception"), (False, "kill"), (True, "exception"), (True, "kill")])
def test_one_rank_fails_and_training_finishes_on_the_survivors(run_job, tmp_path, fixed, mode):
    where = dict(hosts="localhost:2,127.0.0.1:2") if fixed else dict(schedule={None: ["localhost:2", "127.0.0.1:2"]})
    stamp = tmp_path / "killed"
    proc, results, digests = run_elastic(run_job, tmp_path, **where, exit_schedule={"1,0": [0]}, exit_mode=mode,
                                         kill_stamp=str(stamp))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [(r["size"], r["start_rank"], r["rendezvous"]) for r in results] == [(4, 0, 1), (2, 2, 2), (2, 2, 2)]
    assert_same_weights(digests, 2)
    waits = [float(x) for x in Path(f"{stamp}.survivors").read_text().split()]
    # A survivor's blocked collective raised within seconds of the death, never at gloo's 60 s timeout.
    assert waits and max(waits) < 20, waits


def test_sampler_resumes_the_epoch_on_the_smaller_ring(run_job, tmp_path):
    """A rank dies mid-epoch: the survivors restore the sampler's last commit and share out what the epoch has left."""
    samples, batch = 96, 4
    log = tmp_path / "sampler.jsonl"
    proc, results, _ = run_elastic(run_job, tmp_path, schedule={None: ["localhost:2", "127.0.0.1:2"]},
                                   exit_schedule={"1,3": [0]}, samples=str(samples), batch_size=str(batch),
                                   sampler_log=str(log), epochs="2", batches_per_epoch="6")
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    first = [r for r in rows if r["rendezvous"] == 1]
    assert len(first) == 4
    for r in first:  # a fresh epoch over 4 ranks
        assert (r["epoch"], r["processed_num"], r["num_samples"], r["total_size"]) == (0, 0, 24, 96)
    assert sorted(i for r in first for i in r["mine"]) == list(range(samples))
    after = [r for r in rows if r["rendezvous"] == 2]
    assert sorted(r["rank"] for r in after) == [0, 1] and all(r["size"] == 2 for r in after)
    # restored to the commit after 3 batches of epoch 1 on 4 ranks: 3 * 4 * 4 samples are done
    for r in after:
        assert (r["epoch"], r["batch"], r["processed_num"]) == (1, 3, 48), r
        assert (r["num_samples"], r["total_size"]) == (24, 48)
        assert len(r["remaining"]) == 48 and not set(r["remaining"]) & set(r["processed"])
        assert sorted(r["remaining"] + r["processed"]) == list(range(samples))
    assert after[0]["remaining"] == after[1]["remaining"]
    # the two survivors split exactly the remaining samples between them
    assert sorted(i for r in after for i in r["mine"]) == sorted(after[0]["remaining"])


def test_all_ranks_failing_fails_the_job_cleanly(run_job, tmp_path):
    proc, results, _ = run_elastic(run_job, tmp_path, schedule={None: ["localhost:2", "127.0.0.1:2"]},
                                   exit_schedule={"1,0": [0, 1, 2, 3]})
    assert proc.returncode != 0
    assert "every host is blacklisted" in proc.stderr
    assert "scheduled failure" in proc.stderr  # the workers' own errors are shown
    assert [r["size"] for r in results] == [4]


def test_all_hosts_blacklisted_fails_the_job_cleanly(run_job, tmp_path):
    proc, _, _ = run_elastic(run_job, tmp_path, schedule={None: ["localhost:2", "127.0.0.1:2"]},
                             exit_schedule={"1,0": [0, 2]})
    assert proc.returncode != 0
    assert "every host is blacklisted" in proc.stderr


def test_too_few_hosts_past_the_elastic_timeout_fails(run_job, tmp_path):
    proc, _, _ = run_elastic(run_job, tmp_path, np=4, min_np=4, schedule={None: ["localhost:2", "127.0.0.1:2"]},
                             exit_schedule={"1,0": [0]}, extra=["--elastic-timeout", "5"])
    assert proc.returncode != 0
    # The driver or a waiting worker may reach the timeout first (a race on a loaded host); either says why.
    assert ("fewer than --min-np 4 workers could run for 5 s" in proc.stderr
            or "the elastic driver formed no round within 5 s" in proc.stderr), proc.stderr[-2000:]


def test_blacklisted_host_returns_after_its_cooldown(run_job, tmp_path):
    proc, results, digests = run_elastic(
        run_job, tmp_path, schedule={None: ["localhost:2", "127.0.0.1:2"]}, exit_schedule={"1,0": [3]},
        epochs="6", epoch_wait="4", extra=["--blacklist-cooldown-range", "1", "2"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    sizes = [r["size"] for r in results]
    assert sizes[0] == 4 and 2 in sizes, sizes
    assert sizes[-1] == 4, sizes  # 127.0.0.1 came back and was re-admitted
    assert_same_weights(digests, 4)


def test_elastic_with_mpi_is_a_clear_error(run_job, tmp_path):
    proc = run_job(2, [sys.executable, "-c", "pass"], mpi=True, extra_args=["--min-np", "1"], timeout=120)
    assert proc.returncode == 2
    assert "--gloo" in proc.stderr and "elastic" in proc.stderr



def test_shutdown_then_init_again_leaks_no_threads_sockets_or_memory(run_job):
    script = Path(__file__).parent / "scripts" / "reinit.py"
    proc = run_job(2, [sys.executable, str(script), "8"], timeout=JOB_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line.split(":", 1)[1]) for line in proc.stdout.splitlines() if '"round"' in line]
    for rank in (0, 1):
        mine = [r for r in rows if r["rank"] == rank]
        assert len(mine) == 8
        # after the first rounds warm up, every round ends where the previous one did
        assert {r["threads"] for r in mine[2:]} == {mine[2]["threads"]}, mine
        assert {r["fds"] for r in mine[2:]} == {mine[2]["fds"]}, mine
        assert mine[-1]["rss_mib"] - mine[2]["rss_mib"] < 32, mine


def test_powersgd_state_survives_a_reset_from_three_ranks_to_two(run_job, tmp_path):
    """The compressor's state is committed and restored, and synced after the reset: the two survivors
    keep training with PowerSGD and end with identical weights."""
    stamp = tmp_path / "killed"
    proc, results, digests = run_elastic(run_job, tmp_path, np=3, min_np=2, max_np=3, hosts="localhost:2,127.0.0.1:1",
                                         exit_schedule={"1,0": [2]}, kill_stamp=str(stamp),
                                         compression="powersgd:1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [r["size"] for r in results] == [3, 2, 2], results
    assert_same_weights(digests, 2)
