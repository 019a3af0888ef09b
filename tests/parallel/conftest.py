"""Rank-level tests: every rank of a `hora run` job runs the same test functions.

These files are collected only inside a launched job (HORA_RANK or an MPI
rank variable is set); the driver tests in tests/test_multiprocess.py launch
them on 2 and 3 ranks under gloo and MPI.
"""

import os

import pytest

IN_JOB = any(v in os.environ for v in ("HORA_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"))


def pytest_ignore_collect(collection_path, config):
    return not IN_JOB


@pytest.fixture(scope="session", autouse=True)
def hvd_session():
    import hora.torch as hvd

    hvd.init()
    yield hvd
    hvd.shutdown()
