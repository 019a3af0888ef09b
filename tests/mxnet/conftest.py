"""tests/mxnet run where MXNet 1.9.1 is installed (.venv-mxnet, made by ./dev); elsewhere they skip, saying so."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MXNET_VENV_PYTHON = ROOT / ".venv-mxnet" / "bin" / "python"
# Not just find_spec: with tests/ on sys.path this very folder is a namespace package called "mxnet".
_spec = importlib.util.find_spec("mxnet")
HAVE_MXNET = _spec is not None and _spec.origin is not None

needs_mxnet = pytest.mark.skipif(
    not HAVE_MXNET,
    reason=f"mxnet is not installed in {sys.prefix}; MXNet 1.9.1 lives in .venv-mxnet (./dev setup makes it), "
           "where tests/mxnet/test_in_mxnet_venv.py runs these tests",
)
