"""`hora run` on a real Son of Grid Engine: sge_qmaster on h1, sge_execd on h1..h3 of the emulated cluster.

One grid engine serves the module (``cluster.start_sge``: queue ``all.q``
with 2 slots a host, parallel environment ``hora`` with ``control_slaves
TRUE``).  Jobs are submitted from h1 with ``qsub -sync y`` (inside them
``hora run`` picks the sge launcher by itself) or by ``hora run --launcher
sge``, which submits its own.  Debian's gridengine packages are installed by
the test set-up when missing (``system-packages.sh``); where that fails the
tests are skipped with the reason.  Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from hora.testing.emulate import ClusterUnavailable
from tests.cluster.conftest import install_system_packages, netns_pids

pytestmark = [pytest.mark.netns, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "runner" / "scripts"
HOLD = Path(__file__).parent / "scripts" / "hold.py"
PY = sys.executable
CHECK_LINE = re.compile(r"^\[(\d+)\]<stdout>:hora check: rank \d+ of (\d+) \(local \d+ of \d+\) on (h\d) .*: "
                        r"allreduce ok, hosts (\S+)$", re.MULTILINE)


@pytest.fixture(scope="module")
def sge(cluster):
    """The environment (``SGE_ROOT``, ``SGE_CELL``, ports) of the grid engine on the emulated hosts."""
    install_system_packages("sge")
    try:
        env = cluster.start_sge(slots_per_host=2)
    except ClusterUnavailable as e:
        pytest.skip(f"no grid engine on the emulated cluster: {e}")
    yield env
    cluster.stop_sge()


def job_env(sge: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in sge.items() if not k.startswith(("HORA_", "HOROVOD_", "OMPI_", "PMIX_", "DMLC_"))}
    env.pop("OMP_NUM_THREADS", None)
    env["PYTHONPATH"] = str(REPO)
    env["PATH"] = f"{Path(PY).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def qsub_job(cluster, sge, tmp_path, slots: int, *job: str, timeout: float = 150) -> tuple[int, str, str]:
    """``qsub -sync y -pe hora SLOTS JOB`` from h1; the job's exit code, stdout and stderr."""
    out, err = tmp_path / "job.out", tmp_path / "job.err"
    command = ["qsub", "-sync", "y", "-V", "-cwd", "-b", "y", "-pe", "hora", str(slots), "-o", str(out),
               "-e", str(err), *job]
    try:
        result = cluster.run("h1", command, env=job_env(sge), cwd=str(REPO), timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the job did not end in {timeout} s: {e.stdout!r} {e.stderr!r}") from None
    read = (lambda p: p.read_text() if p.exists() else "")
    return result.returncode, read(out), read(err) + result.stderr


def hora_run(*args: str) -> list[str]:
    return [PY, "-m", "hora.runner.cli", "run", *args]


@contextlib.contextmanager
def submitting(cluster, sge, *args: str) -> Iterator[subprocess.Popen]:
    """``hora run --launcher sge ARGS`` on h1 in the background (text pipes), killed at the end if still running."""
    job = cluster.popen("h1", hora_run("--launcher", "sge", *args), env=job_env(sge), cwd=str(REPO),
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield job
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


def job_processes(cluster, baseline: Mapping[str, list[int]]) -> dict[str, list[int]]:
    """The processes on each host beyond ``baseline`` (sshd and the grid engine's daemons)."""
    now = netns_pids(cluster)
    return {host: [p for p in pids if p not in baseline[host]] for host, pids in now.items()}


def wait_clean(cluster, baseline, timeout: float = 20.0) -> dict[str, list[int]]:
    deadline = time.monotonic() + timeout
    while True:
        left = job_processes(cluster, baseline)
        if not any(left.values()) or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


@pytest.mark.timeout(240)
def test_a_pe_job_places_the_ranks_by_pe_hostfile_and_allreduces(cluster, sge, tmp_path):
    script = f"cat \"$PE_HOSTFILE\" >&2; exec {PY} -m hora.runner.cli run --verbose -np 5 {PY} -m hora.runner.check"
    # qsub -b y joins a binary job's arguments for the job's shell: the script is one quoted word
    code, out, err = qsub_job(cluster, sge, tmp_path, 5, "sh", "-c", shlex.quote(script))
    assert code == 0, err[-3000:]
    assert "launcher sge, controller gloo" in err  # chosen by itself inside the parallel job
    granted = [(line.split()[0], int(line.split()[1])) for line in err.splitlines() if " all.q@" in line]
    assert sum(n for _, n in granted) == 5
    expected = [host for host, n in granted for _ in range(n)]  # ranks fill the hosts in the file's order
    placed = {int(rank): (host, hosts) for rank, size, host, hosts in CHECK_LINE.findall(out)}
    assert sorted(placed) == [0, 1, 2, 3, 4], out
    assert [placed[r][0] for r in range(5)] == expected
    assert {hosts for _, hosts in placed.values()} == {",".join(expected)}


@pytest.mark.timeout(240)
def test_hora_run_submits_a_job_streams_its_output_and_returns_its_status(cluster, sge):
    rank = f"{PY} -m hora.runner.check && sleep 3"  # the check's line must arrive while the ranks still run
    job = cluster.popen("h1", hora_run("--launcher", "sge", "-np", "3", "sh", "-c", rank),
                        env=job_env(sge), cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first_line_at = []
    stdout_lines: list[str] = []

    def read() -> None:
        for line in job.stdout:  # type: ignore[union-attr]
            first_line_at.append(time.monotonic())
            stdout_lines.append(line)

    err_lines: list[str] = []
    readers = [threading.Thread(target=read, daemon=True),
               threading.Thread(target=lambda: err_lines.extend(job.stderr), daemon=True)]  # type: ignore[arg-type]
    for reader in readers:
        reader.start()
    try:
        job.wait(timeout=150)
    except subprocess.TimeoutExpired:
        job.kill()
        raise AssertionError("hora run --launcher sge did not end in 150 s") from None
    ended = time.monotonic()
    for reader in readers:
        reader.join(10)
    out, err = "".join(stdout_lines), "".join(err_lines)
    assert job.returncode == 0, err[-3000:]
    assert re.search(r"hora run: submitted grid engine job \d+ \(qdel \d+ stops it\)", err), err
    assert len(CHECK_LINE.findall(out)) == 3, out
    assert ended - first_line_at[0] > 2.0, f"the first line came {ended - first_line_at[0]:.1f} s before the end"
    assert not list((REPO).glob(".hora-sge-*")), "the job's output files were left behind"


@pytest.mark.timeout(240)
def test_a_pe_job_with_a_parameter_server_runs_dist_sync(cluster, sge, tmp_path):
    code, out, err = qsub_job(cluster, sge, tmp_path, 3,
                              *hora_run("--verbose", "-np", "2", "-s", "1", PY, str(SCRIPTS / "ps_sum.py")))
    assert code == 0, err[-3000:]
    oks = sorted(line for line in out.splitlines() if "dist_sync sums ok" in line)
    assert len(oks) == 2 and all(re.match(r"^\[\d\]<stdout>:worker \d of 2 on h\d: dist_sync sums ok$", o)
                                 for o in oks), out
    assert re.search(r"scheduler on h\d, server 0 on h\d", err), err


@pytest.mark.timeout(240)
def test_launch_py_spelling_submits_workers_and_servers(cluster, sge):
    # MXNet: python launch.py -n 2 -s 1 --launcher sge python train.py
    result = cluster.run("h1", hora_run("-n", "2", "-s", "1", "--launcher", "sge", PY, str(SCRIPTS / "ps_sum.py")),
                         env=job_env(sge), cwd=str(REPO), timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len([line for line in result.stdout.splitlines() if "dist_sync sums ok" in line]) == 2, result.stdout


@pytest.mark.timeout(240)
def test_killing_a_rank_ends_the_job_with_the_root_cause(cluster, sge):
    baseline = netns_pids(cluster)
    with submitting(cluster, sge, "-np", "4", PY, str(HOLD)) as job:
        ready = _ready(job, 4)
        victim = max(ready)
        start = time.monotonic()
        os.kill(ready[victim][1], signal.SIGKILL)
        stdout, stderr = job.communicate(timeout=30)
    elapsed = time.monotonic() - start
    assert job.returncode != 0
    assert elapsed < 30, f"the job took {elapsed:.1f} s to end"
    assert f"root cause: rank {victim} on {ready[victim][0]} was killed by signal SIGKILL (9)" in stderr, stderr
    assert "was not stopped" not in stdout
    assert wait_clean(cluster, baseline) == {h.name: [] for h in cluster.hosts}


@pytest.mark.timeout(240)
def test_qdel_leaves_no_process_on_any_host(cluster, sge, tmp_path):
    baseline = netns_pids(cluster)
    # Each rank also starts a child in its own process group, which qdel alone would not reach.
    marker = tmp_path / "child"
    rank = f"sleep 300 & echo $! >> {marker}; exec {PY} {HOLD}"
    err_lines: list[str] = []
    with submitting(cluster, sge, "-np", "4", "sh", "-c", rank) as job:
        threading.Thread(target=lambda: err_lines.extend(job.stderr), daemon=True).start()  # type: ignore[arg-type]
        _ready(job, 4)
        job_id = next(m.group(1) for line in err_lines if (m := re.search(r"grid engine job (\d+)", line)))
        assert cluster.run("h1", ["qdel", job_id], env=job_env(sge), timeout=30).returncode == 0
        job.wait(timeout=60)
    assert job.returncode != 0, "".join(err_lines)
    assert len(marker.read_text().split()) == 4
    assert wait_clean(cluster, baseline) == {h.name: [] for h in cluster.hosts}


@pytest.mark.timeout(240)
def test_sigterm_to_hora_run_deletes_the_submitted_job(cluster, sge):
    baseline = netns_pids(cluster)
    with submitting(cluster, sge, "-np", "3", PY, str(HOLD)) as job:
        _ready(job, 3)
        job.send_signal(signal.SIGTERM)
        _, stderr = job.communicate(timeout=60)
    assert job.returncode == 128 + signal.SIGTERM, stderr
    assert "stopped all workers after receiving SIGTERM" in stderr
    assert wait_clean(cluster, baseline, timeout=30) == {h.name: [] for h in cluster.hosts}
    # qdel is asynchronous: the job may show as deleting ("dr") for a moment before it leaves the queue.
    deadline = time.monotonic() + 30
    while (queued := cluster.run("h1", ["qstat", "-u", "*"], env=job_env(sge), timeout=30)).stdout.strip():
        assert time.monotonic() < deadline, f"the job is still queued 30 s after hora run ended:\n{queued.stdout}"
        time.sleep(0.5)


def _ready(job: subprocess.Popen, n: int, timeout: float = 120) -> dict[int, tuple[str, int]]:
    """Read ``ready RANK HOST PID`` lines from the job's stdout until ``n`` ranks said them."""
    ready: dict[int, tuple[str, int]] = {}
    timer = threading.Timer(timeout, job.kill)  # a job that never gets ready ends the read
    timer.start()
    try:
        for line in job.stdout:  # type: ignore[union-attr]
            if "<stdout>:ready " in line:
                _, rank, host, pid = line.split("<stdout>:", 1)[1].split()
                ready[int(rank)] = (host, int(pid))
            if len(ready) == n:
                return ready
    finally:
        timer.cancel()
    raise AssertionError(f"only {len(ready)} of {n} ranks got ready within {timeout} s")


@pytest.fixture(scope="module")
def pe_without_control(cluster, sge, tmp_path_factory):
    """A parallel environment ``loose`` with ``control_slaves FALSE``, on all.q."""
    template = tmp_path_factory.mktemp("pe") / "loose"
    run = cluster.run("h1", ["qconf", "-sp", "hora"], env=job_env(sge), timeout=30)
    template.write_text(run.stdout.replace("pe_name            hora", "pe_name loose").replace(
        "control_slaves     TRUE", "control_slaves FALSE"))
    for command in (["qconf", "-Ap", str(template)], ["qconf", "-aattr", "queue", "pe_list", "loose", "all.q"]):
        result = cluster.run("h1", command, env=job_env(sge), timeout=30)
        assert result.returncode == 0, result.stderr
    return "loose"


@pytest.mark.timeout(240)
def test_errors_name_the_fix(cluster, sge, pe_without_control, tmp_path):
    env = job_env(sge)
    # submitting to a PE whose control_slaves is FALSE: refused before anything is queued
    result = cluster.run("h1", hora_run("--launcher", "sge", "--sge-pe", "loose", "-np", "2", PY, "-c", "pass"),
                         env=env, cwd=str(REPO), timeout=60)
    assert result.returncode != 0
    assert "'loose' has control_slaves FALSE" in result.stderr and "qconf -mp loose" in result.stderr, result.stderr
    # a parallel environment that does not exist: qsub's reason, and where to look
    result = cluster.run("h1", hora_run("--launcher", "sge", "--sge-pe", "nosuch", "-np", "2", PY, "-c", "pass"),
                         env=env, cwd=str(REPO), timeout=60)
    assert result.returncode != 0
    assert "qsub did not submit the job; check the parallel environment (--sge-pe nosuch" in result.stderr
    assert "nosuch" in result.stderr.split("qconf -sql lists them)", 1)[1], result.stderr  # qsub's own words
    # inside such a job, qrsh -inherit is refused: the error says why
    code, _, err = qsub_job(cluster, sge, tmp_path, 2, *hora_run("-np", "2", PY, "-c", "pass"), timeout=120)
    assert code == 0 and "error" not in err.lower(), err  # (the same job in the right PE works)
    out, err_file = tmp_path / "loose.out", tmp_path / "loose.err"
    result = cluster.run("h1", ["qsub", "-sync", "y", "-V", "-cwd", "-b", "y", "-pe", "loose", "2", "-o", str(out),
                                "-e", str(err_file), *hora_run("-np", "2", PY, "-c", "pass")],
                         env=env, cwd=str(REPO), timeout=120)
    said = err_file.read_text()
    assert result.returncode != 0
    assert "cannot be reached: qrsh -inherit exited" in said and "'loose' has control_slaves FALSE" in said, said
    # fewer slots granted than -np asks for
    code, _, err = qsub_job(cluster, sge, tmp_path, 2, *hora_run("-np", "3", PY, "-c", "pass"), timeout=120)
    assert code != 0
    assert "granted this job 2 slots, but -np 3 need 3: submit with 'qsub -pe hora 3'" in err, err
