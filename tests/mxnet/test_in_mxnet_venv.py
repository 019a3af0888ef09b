"""From the main venv (no MXNet): run tests/mxnet in .venv-mxnet, where MXNet 1.9.1 and numpy<1.24 live.

``./dev test`` sets .venv-mxnet up (``setup_mxnet``) and runs the main suite,
which includes this test (not marked slow, so the default run has it); so one
command runs both.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import job_env
from tests.mxnet.conftest import HAVE_MXNET, MXNET_VENV_PYTHON, ROOT


@pytest.mark.timeout(1500)
@pytest.mark.skipif(HAVE_MXNET, reason="this interpreter has mxnet: the tests of tests/mxnet run here directly")
@pytest.mark.skipif(not MXNET_VENV_PYTHON.exists(), reason=f"{MXNET_VENV_PYTHON} is missing: ./dev setup makes it")
def test_mxnet_suite_in_its_own_venv():
    proc = subprocess.run(
        [str(MXNET_VENV_PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning",
         "tests/mxnet", f"--ignore={__file__}"],
        cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=1400,
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], tail
