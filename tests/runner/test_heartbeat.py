"""Host-loss heartbeats: the bookkeeping, the agent's side of the beats, and the report of a tool-run job.

The agent is started with ``sh -c`` as sshd would start it; a launcher that
goes silent (its stdin stays open, nothing arrives: what a cut link looks
like from the agent) must make it stop what it runs, and a beating launcher
must not.  The mpi/srun supervisor is given a host watch that reports a lost
host: the tool is stopped and the report names the host.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hora.config import HeartbeatConfig
from hora.errors import ConfigError
from hora.runner.agent import MARKER
from hora.runner.heartbeat import Beater, Liveness, lost_note
from hora.runner.launchers.base import Interrupt, Slot
from hora.runner.launchers.mpi import ToolSupervisor
from hora.runner.output import OutputSink
from hora.runner.ssh import agent_command


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_liveness_reports_a_silent_peer_once_and_only_after_the_deadline():
    clock = FakeClock()
    live = Liveness(8.0, clock=clock)
    live.watch("h1")
    live.watch("h3")
    clock.now += 5
    live.beat("h1")
    assert live.newly_lost() == []
    clock.now += 3.5  # h3 silent 8.5 s, h1 3.5 s
    assert live.newly_lost() == [("h3", 8.5)]
    assert live.newly_lost() == []  # reported once
    live.beat("h3")  # a late beat does not bring a lost host back
    assert "h3" in live.lost
    clock.now += 5
    assert live.newly_lost() == [("h1", 8.5)]
    live.watch("h3")  # watched anew (a new job on it)
    assert live.silence("h3") == 0 and "h3" not in live.lost


def test_liveness_forgets_peers_that_finished():
    clock = FakeClock()
    live = Liveness(2.0, clock=clock)
    live.watch("h2")
    live.forget("h2")
    clock.now += 10
    assert live.newly_lost() == []
    live.beat("h2")  # unknown: ignored
    assert live.heard == {}


def test_lost_note_names_the_host_the_silence_and_the_knob():
    note = lost_note("h3", 8.25, HeartbeatConfig())
    assert note.startswith("lost: h3 stopped answering (no heartbeat for 8.2 s, last heard at ")
    assert "HORA_HEARTBEAT_TIMEOUT=8" in note


def test_heartbeat_config_reads_the_environment_and_refuses_a_deadline_under_two_beats():
    assert HeartbeatConfig.from_env({}) == HeartbeatConfig(interval_s=1.0, timeout_s=8.0)
    config = HeartbeatConfig.from_env({"HORA_HEARTBEAT_INTERVAL": "0.5", "HORA_HEARTBEAT_TIMEOUT": "3"})
    assert (config.interval_s, config.timeout_s) == (0.5, 3.0)
    with pytest.raises(ConfigError, match="HORA_HEARTBEAT_TIMEOUT=1 at least twice"):
        HeartbeatConfig(interval_s=1.0, timeout_s=1.0)
    with pytest.raises(ConfigError, match="HORA_HEARTBEAT_INTERVAL"):
        HeartbeatConfig.from_env({"HORA_HEARTBEAT_INTERVAL": "0"})
    with pytest.raises(ConfigError, match="is not a number"):
        HeartbeatConfig.from_env({"HORA_HEARTBEAT_TIMEOUT": "soon"})


@pytest.mark.timeout(30)
def test_beater_beats_every_peer_until_stopped_and_survives_a_failing_one():
    beats: list[str] = []

    def send(peer: object) -> None:
        if peer == "bad":
            raise OSError("gone")
        beats.append(str(peer))

    beater = Beater(lambda: ["good", "bad"], send, 0.05).start()
    deadline = time.monotonic() + 10
    while beats.count("good") < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    beater.stop()
    assert beats.count("good") >= 3
    time.sleep(0.3)
    count = len(beats)
    time.sleep(0.3)
    assert len(beats) == count, "beats went on after stop()"


class _Agent:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(["sh", "-c", agent_command(os.environ.get("PATH"))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def send(self, **record) -> None:
        self.proc.stdin.write(json.dumps(record).encode() + b"\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]

    def records(self, kind: str, timeout: float) -> list[dict]:
        """Agent records up to and including the first of ``kind`` (AssertionError after ``timeout``)."""
        deadline = time.monotonic() + timeout
        found = []
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                break
            if line.startswith(MARKER):
                found.append(json.loads(line[len(MARKER):]))
                if kind in found[-1]:
                    return found
        raise AssertionError(f"no {kind!r} record within {timeout} s; got {found}")


@pytest.fixture
def agent():
    started = _Agent()
    yield started
    if started.proc.poll() is None:
        started.proc.kill()
    started.proc.wait(timeout=10)


@pytest.mark.timeout(60)
def test_an_agent_whose_launcher_falls_silent_stops_its_processes(agent):
    agent.records("hello", 20)
    agent.send(op="spec", cwd=os.getcwd(), env={}, grace=0.5, heartbeat=[0.2, 1.5], processes=[
        {"key": "0", "argv": [sys.executable, "-c", "import time; time.sleep(60)"], "env": {}},
    ])
    agent.records("ready", 20)
    agent.send(op="start")
    start = time.monotonic()
    # Nothing more is sent, but stdin stays open: the launcher's packets just stop arriving.
    seen = agent.records("exit", 20)
    assert time.monotonic() - start >= 1.0, "the agent gave up before the heartbeat deadline"
    assert seen[-1]["exit"]["returncode"] == -signal.SIGTERM
    assert sum("beat" in r for r in seen) >= 3  # it beat meanwhile
    assert agent.proc.wait(timeout=10) == 0


@pytest.mark.timeout(60)
def test_a_watch_agent_beats_while_the_launcher_beats_and_leaves_when_it_stops(agent):
    agent.records("hello", 20)
    agent.send(op="spec", cwd="/", env={}, processes=[], watch=True, heartbeat=[0.2, 1.5])
    agent.records("ready", 20)
    agent.send(op="start")
    until = time.monotonic() + 3.0  # twice the deadline, kept alive by our beats
    while time.monotonic() < until:
        agent.send(op="beat")
        time.sleep(0.2)
    assert agent.proc.poll() is None, "the watch agent left although the launcher kept beating"
    start = time.monotonic()
    assert agent.proc.wait(timeout=15) == 0
    assert time.monotonic() - start >= 1.0


class _LostH3:
    def __init__(self) -> None:
        self.calls = 0

    def lost(self) -> list[tuple[str, str]]:
        self.calls += 1
        return [("h3", lost_note("h3", 8.1, HeartbeatConfig()))] if self.calls == 5 else []


@pytest.mark.timeout(60)
def test_a_tool_whose_host_is_lost_is_stopped_and_the_report_names_the_host():
    # The "tool" ignores SIGTERM, as mpirun waiting on an unreachable daemon does: it is killed after the grace.
    tool = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                             "signal.SIG_IGN); time.sleep(60)"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    slots = [Slot(rank=r, size=3, local_rank=0, local_size=1, cross_rank=r, cross_size=3, host=h)
             for r, h in enumerate(("h1", "h2", "h3"))]
    start = time.monotonic()
    sink = OutputSink(sys.stdout, sys.stderr)
    result = ToolSupervisor(tool, slots, sink, Interrupt(), grace=1.0, watch=_LostH3()).run()
    assert time.monotonic() - start < 10
    assert tool.returncode == -signal.SIGKILL
    assert result.exit_code == 255
    assert result.root_cause is not None and result.root_cause.host == "h3" and result.root_cause.rank == 2
    assert "lost: h3 stopped answering" in result.root_cause.describe()


@pytest.mark.timeout(60)
def test_beats_keep_a_ready_agent_waiting_for_the_start_past_the_deadline(agent):
    agent.records("hello", 20)
    agent.send(op="spec", cwd=os.getcwd(), env={}, grace=0.5, heartbeat=[0.2, 1.0], processes=[
        {"key": "0", "argv": [sys.executable, "-c", "print('ran')"], "env": {}},
    ])
    agent.records("ready", 20)
    until = time.monotonic() + 2.5  # another host is slow to get ready: the launcher only beats
    while time.monotonic() < until:
        agent.send(op="beat")
        time.sleep(0.2)
    agent.send(op="start")
    assert agent.records("exit", 20)[-1]["exit"] == {"key": "0", "returncode": 0}
    assert agent.proc.wait(timeout=10) == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rank_ran", [False, True])
def test_open_mpis_start_up_race_is_told_apart_from_a_job_that_ran(rank_ran):
    # mpirun losing its PMIx listener race before any rank ran may be started again; once a rank ran, never.
    said = "print('[0]<stdout>:step 1', flush=True); " if rank_ran else ""
    race = "The PMIx server's listener thread failed to start. We cannot"
    code = f"import sys; {said}print({race!r}, file=sys.stderr); sys.exit(213)"
    tool = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    slots = [Slot(rank=r, size=2, local_rank=r, local_size=2, cross_rank=0, cross_size=1, host="localhost")
             for r in range(2)]
    supervisor = ToolSupervisor(tool, slots, OutputSink(sys.stdout, sys.stderr), Interrupt(), grace=1.0)
    result = supervisor.run()
    assert result.exit_code != 0
    assert supervisor.failed_to_start() is (not rank_ran)
    assert supervisor.start_failure == race
