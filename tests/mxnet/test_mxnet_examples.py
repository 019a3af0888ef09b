"""The MXNet examples reach 0.95 test accuracy on the digits under hora run -np 2 (MPI)."""

from __future__ import annotations

import re
import sys

import pytest

from tests.conftest import hora_run
from tests.mxnet.conftest import needs_mxnet

pytestmark = needs_mxnet


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script, args", [
    ("examples/mxnet/train_gluon_digits.py", []),
    ("examples/mxnet/train_module_digits.py", []),
    ("examples/mxnet/train_module_digits.py", ["--kv-store", "hora"]),
])
def test_example_reaches_the_accuracy(script, args):
    proc = hora_run(2, [sys.executable, script, "--min-accuracy", "0.95", *args], mpi=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    match = re.search(r"final test accuracy ([0-9.]+) on 2 process", proc.stdout)
    assert match and float(match.group(1)) >= 0.95, out[-4000:]
