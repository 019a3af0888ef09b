"""The ssh launcher's per-host agent, driven through ``sh -c`` exactly as sshd would run its command.

These start real processes on this machine only: they check the quoting of
the remote command (environment values and a working directory with
spaces, quotes, ``$`` and newlines arrive unchanged), the ready/error
answers, signals, and that closing the control channel (what a broken ssh
connection does) stops everything the agent started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hora.runner.agent import MARKER
from hora.runner.ssh import agent_command

NASTY = "it's \"quoted\" $HOME `date` \\ back\nslash; rm -rf /tmp/nothing &"


class Agent:
    """An agent started with ``sh -c REMOTE_COMMAND``; records are read from its stdout."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            ["sh", "-c", agent_command(os.environ.get("PATH"))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        self.lines: list[bytes] = []

    def send(self, **record) -> None:
        self.proc.stdin.write(json.dumps(record).encode() + b"\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]

    def record(self, kind: str, timeout: float = 20) -> dict:
        """The next agent record of ``kind`` (other lines are kept in ``self.lines``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                break
            if line.startswith(MARKER):
                record = json.loads(line[len(MARKER):])
                if kind in record:
                    return record
            self.lines.append(line)
        raise AssertionError(f"no {kind!r} record; stderr: {self.proc.stderr.read()!r}")  # type: ignore[union-attr]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def agent():
    started = Agent()
    yield started
    started.close()


@pytest.mark.timeout(60)
def test_hello_then_processes_get_env_and_cwd_unchanged(agent, tmp_path):
    hello = agent.record("hello")["hello"]
    assert hello["python"] and hello["hostname"] and len(hello["ports"]) == 2 and "lo" in hello["addrs"]
    workdir = tmp_path / "dir with 'quotes' and $pace"
    workdir.mkdir()
    code = ("import os, json; "
            "print(json.dumps([os.getcwd(), os.environ['NASTY'], os.environ['KEY'], os.environ['HORA_X']]))")
    agent.send(op="spec", cwd=str(workdir), env={"NASTY": NASTY, "HORA_X": "common"}, grace=1.0, processes=[
        {"key": "0", "argv": [sys.executable, "-c", code], "env": {"KEY": "zero"}},
        {"key": "server 0", "argv": [sys.executable, "-c", code], "env": {"KEY": "srv"}},
    ])
    agent.record("ready")
    agent.send(op="start")
    exits = [agent.record("exit")["exit"] for _ in range(2)]
    assert sorted((e["key"], e["returncode"]) for e in exits) == [("0", 0), ("server 0", 0)]
    agent.record("done")
    outputs = {}
    for line in agent.lines:
        prefix, _, payload = line.partition(b">:")
        if payload.startswith(b"["):
            outputs[prefix.decode()] = json.loads(payload)
    assert outputs == {
        "[0]<stdout": [str(workdir), NASTY, "zero", "common"],
        "[server 0]<stdout": [str(workdir), NASTY, "srv", "common"],
    }
    assert agent.proc.wait(timeout=10) == 0


@pytest.mark.timeout(60)
def test_missing_program_or_directory_is_an_error_before_anything_starts(agent, tmp_path):
    agent.record("hello")
    agent.send(op="spec", cwd=str(tmp_path), env={}, processes=[
        {"key": "0", "argv": [sys.executable, "-c", "pass"], "env": {}},
        {"key": "1", "argv": ["no_such_program_xyz"], "env": {}},
    ])
    assert agent.record("error")["error"] == "cannot run 'no_such_program_xyz': command not found on PATH"
    assert agent.proc.wait(timeout=10) == 1
    other = Agent()
    try:
        other.record("hello")
        other.send(op="spec", cwd=str(tmp_path / "gone"), env={}, processes=[])
        assert "the working directory" in other.record("error")["error"]
    finally:
        other.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its parent counts as gone
        return f.read().split(") ", 1)[1][0] != "Z"


@pytest.mark.timeout(60)
def test_closing_the_channel_stops_every_process_the_agent_started(agent):
    agent.record("hello")
    code = ("import os, signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
            "print(os.getpid(), child.pid, flush=True); time.sleep(60)")
    agent.send(op="spec", cwd=os.getcwd(), env={}, grace=0.5, processes=[
        {"key": "0", "argv": [sys.executable, "-c", code], "env": {}},
    ])
    agent.record("ready")
    agent.send(op="start")
    while True:
        line = agent.proc.stdout.readline()  # type: ignore[union-attr]
        if line.startswith(b"[0]<stdout>:"):
            pids = [int(p) for p in line.split(b":", 1)[1].split()]
            break
    assert all(_alive(pid) for pid in pids)
    start = time.monotonic()
    agent.proc.stdin.close()  # type: ignore[union-attr]  # as if the ssh connection broke
    exit_ = agent.record("exit")["exit"]
    assert exit_ == {"key": "0", "returncode": -signal.SIGKILL}  # it ignored SIGTERM: killed after the grace
    assert agent.proc.wait(timeout=10) == 0
    assert time.monotonic() - start < 5
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids), "the process or its child survived"


@pytest.mark.timeout(60)
def test_signal_reaches_only_the_named_processes(agent):
    agent.record("hello")
    wait = "import time; print('up', flush=True); time.sleep(60)"
    agent.send(op="spec", cwd=os.getcwd(), env={}, processes=[
        {"key": "0", "argv": [sys.executable, "-c", wait], "env": {}},
        {"key": "1", "argv": [sys.executable, "-c", wait], "env": {}},
    ])
    agent.record("ready")
    agent.send(op="start")
    up = 0
    while up < 2:
        up += agent.proc.stdout.readline().endswith(b"up\n")  # type: ignore[union-attr]
    agent.send(op="signal", signum=int(signal.SIGTERM), keys=["1"])
    assert agent.record("exit")["exit"] == {"key": "1", "returncode": -signal.SIGTERM}
    agent.send(op="signal", signum=int(signal.SIGKILL), keys=["0"])
    assert agent.record("exit")["exit"] == {"key": "0", "returncode": -signal.SIGKILL}
    agent.record("done")
