"""The emulated cluster's bookkeeping, without namespaces: who owns a registered cluster, and missing tools."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from hora.testing import emulate
from hora.testing.emulate import ClusterUnavailable


@pytest.fixture(params=["proc", "psutil"])
def start_times(request, monkeypatch):
    """Run a test once reading start times from /proc, once through a psutil module (a stand-in if absent)."""
    if request.param == "proc":
        monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil now raises ImportError
        return request.param
    try:
        import psutil  # noqa: F401
    except ImportError:
        fake = types.ModuleType("psutil")

        class NoSuchProcess(Exception):
            pass

        class Process:
            def __init__(self, pid: int) -> None:
                self.started = emulate._proc_start_time(pid)
                if self.started is None:
                    raise NoSuchProcess(pid)

            def create_time(self) -> float:
                return self.started

        fake.NoSuchProcess, fake.Error, fake.Process = NoSuchProcess, Exception, Process
        monkeypatch.setitem(sys.modules, "psutil", fake)
    return request.param


def test_a_live_owner_is_alive_with_its_recorded_start_time(start_times):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        started = emulate._start_time(child.pid)
        assert started is not None
        assert emulate._process_alive(child.pid, started)
        assert emulate._process_alive(child.pid, None)
        # the same pid with another start time is a reused pid: the owner is dead
        assert not emulate._process_alive(child.pid, started - 5.0)
    finally:
        child.kill()
        child.wait()
    assert not emulate._process_alive(child.pid, started)


def test_both_ways_of_reading_a_start_time_agree(start_times):
    own = emulate._own_start_time()
    assert own is not None
    assert abs(own - emulate._proc_start_time(os.getpid())) < 1.0
    assert emulate._process_alive(os.getpid(), own)


def test_a_missing_tool_names_the_apt_get_command(monkeypatch):
    monkeypatch.setattr(emulate, "_which", lambda tool: None if tool in ("qsub", "sge_execd") else "/bin/true")
    with pytest.raises(ClusterUnavailable) as info:
        emulate.require_tools(("qsub", "sge_execd", "ssh"), "start_sge()")
    message = str(info.value)
    assert "start_sge() needs qsub, sge_execd" in message
    assert "run: apt-get install -y gridengine-client gridengine-exec" in message
    emulate.require_tools(("ssh",), "anything")  # present: no error


def test_the_library_never_runs_apt_get():
    with open(emulate.__file__, encoding="utf-8") as f:
        code = f.read()
    assert '"apt-get"' not in code and "'apt-get'" not in code
