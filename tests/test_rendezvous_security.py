"""The gloo rendezvous store against an outsider (issue 19): torch's TCPStore has no authentication.

An outsider that reaches the port can list, read and write keys.  hora signs
every value with the job secret and keeps keys under a secret-derived
prefix, so a planted value is ignored (the job's own wins), nothing read
from the store reveals the secret, and a store that is not the job's is a
clear error instead of a rendezvous with strangers.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

# tests/conftest.py by path: under a whole-suite run the name "conftest" may be another directory's
_spec = importlib.util.spec_from_file_location("hora_tests_conftest", Path(__file__).with_name("conftest.py"))
_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conftest)
ROOT, job_env = _conftest.ROOT, _conftest.job_env

pytestmark = pytest.mark.timeout(180)
dist = pytest.importorskip("torch.distributed")

SCRIPT = ROOT / "tests" / "scripts" / "rendezvous_job.py"


def _rank0_store(job: subprocess.Popen, deadline: float) -> tuple[str, int, str]:
    """Rank 0's rendezvous address and port (what a port scan finds), and the secret (to check for leaks)."""
    while time.monotonic() < deadline:
        for p in psutil.Process(job.pid).children(recursive=True):
            try:
                env = p.environ()
            except psutil.Error:
                continue
            if env.get("HORA_RANK") == "0" and "rendezvous_job" in " ".join(p.cmdline()):
                return env["HORA_RENDEZVOUS_ADDR"], int(env["HORA_RENDEZVOUS_PORT"]), env["HORA_SECRET"]
        time.sleep(0.05)
    raise AssertionError("rank 0 of the job did not start")


def test_outsider_cannot_join_or_corrupt_a_gloo_rendezvous(tmp_path):
    """While rank 1 is held back, an outsider lists rank 0's keys and plants rank 1's entries (a forged
    join); the job still forms with the real rank 1 and sums exactly, and no stored value holds the secret."""
    go = tmp_path / "go"
    out = open(tmp_path / "job.out", "w")
    job = subprocess.Popen([sys.executable, "-m", "hora.runner.cli", "run", "-np", "2", "--gloo", sys.executable,
                            str(SCRIPT)], cwd=ROOT, env=job_env({"GO_FILE": str(go)}), stdout=out,
                           stderr=subprocess.STDOUT, start_new_session=True)
    out.close()
    try:
        deadline = time.monotonic() + 60
        addr, port, secret = _rank0_store(job, deadline)
        outsider = None
        while outsider is None:
            assert time.monotonic() < deadline and job.poll() is None, (tmp_path / "job.out").read_text()
            try:
                outsider = dist.TCPStore(addr, port, None, False, datetime.timedelta(seconds=5),
                                         wait_for_workers=False)
            except Exception:
                time.sleep(0.1)
        planted: set[str] = set()
        window = float("inf")  # plant for 2 s after the first of rank 0's entries appears, then let rank 1 in
        while time.monotonic() < min(deadline, window) and job.poll() is None:
            keys = [k for k in outsider.list_keys() if k.endswith("/0")]
            if keys and window == float("inf"):
                window = time.monotonic() + 2
            for key in keys:
                value = outsider.get(key)
                assert secret.encode() not in value and secret.encode().hex().encode() not in value
                forged = key[:-1] + "1"
                if forged not in planted:
                    outsider.set(forged, value)  # a copy of rank 0's entry, as if rank 1 had written it
                    planted.add(forged)
            time.sleep(0.05)
        assert planted, f"the outsider saw no rendezvous keys\n{(tmp_path / 'job.out').read_text()}"
        go.touch()
        assert job.wait(timeout=120) == 0, (tmp_path / "job.out").read_text()
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
            job.wait()
    text = (tmp_path / "job.out").read_text()
    assert text.count("RESULT 0 3 6 9") == 2, text
    assert "did not sign" in text, text  # rank 0 saw the planted entry and waited for the real one


def test_a_store_that_is_not_the_jobs_is_a_clear_error():
    """A rank that finds a stranger's store on the rendezvous port (it took the port first) says so."""
    from hora.core.backends.torch_dist import connect_store
    from hora.errors import BackendError

    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stranger = dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    stranger.set("hora/job", b"x" * 40)
    t0 = time.monotonic()
    with pytest.raises(BackendError, match="rendezvous store at 127.0.0.1"):
        connect_store("127.0.0.1", port, 1, 2, False, 2.0, secret="the job's secret")
    assert time.monotonic() - t0 < 30


def test_signed_store_ignores_planted_values_until_the_jobs_own_arrives():
    from hora.core.backends import signed_store
    from hora.errors import BackendError

    inner = dist.HashStore()
    store = signed_store.SignedStore(inner, "s3cret", timeout_s=0.5)
    raw = dist.PrefixStore(signed_store.prefix("s3cret"), inner)
    raw.set("addr/1", b"10.6.6.6:1")  # planted by someone without the secret
    with pytest.raises(BackendError, match="not signed"):
        store.get("addr/1")
    store.set("addr/1", b"10.0.0.2:5000")
    assert store.get("addr/1") == b"10.0.0.2:5000"
    assert b"s3cret" not in inner.get(signed_store.prefix("s3cret") + "/addr/1")
    assert signed_store.SignedStore(inner, "another job", timeout_s=0.2).check(["addr/1"]) is False  # apart
