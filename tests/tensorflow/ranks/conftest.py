"""Rank-level TensorFlow/Keras tests: collected only inside a `hora run` job (see tests/tensorflow/test_jobs.py).

``HORA_TEST_KERAS`` picks the binding the session starts: ``tf`` (hora.tensorflow,
the default), ``keras3`` (hora.keras, on ``KERAS_BACKEND``) or ``tfkeras``
(hora.tensorflow.keras under ``TF_USE_LEGACY_KERAS=1``).
"""

import os

import pytest

IN_JOB = any(v in os.environ for v in ("HORA_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"))
FLAVOUR = os.environ.get("HORA_TEST_KERAS", "tf")


def pytest_configure(config):
    # Every rank runs the same session: give each its own temporary directory, or they remove each other's.
    if IN_JOB and not config.option.basetemp:
        import tempfile

        rank = next(os.environ[v] for v in ("HORA_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK") if v in os.environ)
        config.option.basetemp = tempfile.mkdtemp(prefix=f"hora-tf-tests-rank{rank}-")
        config._hora_basetemp = config.option.basetemp


def pytest_unconfigure(config):
    # The directory is this session's own (made above): remove it, or every run leaves one per rank in /tmp.
    made = getattr(config, "_hora_basetemp", None)
    if made:
        import shutil

        shutil.rmtree(made, ignore_errors=True)


def pytest_ignore_collect(collection_path, config):
    if not IN_JOB:
        return True
    name = collection_path.name
    if name.startswith("test_tf_") and FLAVOUR != "tf":
        return True
    if name.startswith("test_keras_") and FLAVOUR == "tf":
        return True
    return None


@pytest.fixture(scope="session", autouse=True)
def hvd_session():
    if FLAVOUR == "keras3":
        import hora.keras as hvd
    elif FLAVOUR == "tfkeras":
        import hora.tensorflow.keras as hvd
    else:
        import hora.tensorflow as hvd
    hvd.init()
    yield hvd
    hvd.shutdown()
