"""benchmarks/horovod_compat.py: the import rewrite and the offline MNIST stand-in's formats."""

from __future__ import annotations

import gzip
import importlib.util
import zipfile

import numpy as np
import pytest

from tests.conftest import ROOT

pytest.importorskip("sklearn")


@pytest.fixture(scope="module")
def compat():
    spec = importlib.util.spec_from_file_location("horovod_compat", ROOT / "benchmarks" / "horovod_compat.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_only_the_imports_change(compat):
    text = ("import horovod\nimport horovod.torch as hvd\n    import horovod.tensorflow.keras as hvd\n"
            "from horovod.runner.common.util import env\nx = horovod.run(main)  # import horovod.torch as hvd\n")
    assert compat.change_imports(text) == (
        "import hora as horovod\nimport hora.torch as hvd\n    import hora.tensorflow.keras as hvd\n"
        "from hora.runner.common.util import env\nx = horovod.run(main)  # import horovod.torch as hvd\n")


def test_offline_data_has_mnist_s_shapes_in_each_format(compat, tmp_path):
    parts = compat.write_data(tmp_path, ranks=2)
    images, labels = parts["train_images"], parts["train_labels"]
    assert images.shape[1:] == (28, 28) and images.dtype == np.uint8 and images.max() == 255
    assert set(labels.tolist()) == set(range(10))
    with np.load(tmp_path / "home/.keras/datasets/mnist-1.npz") as f:
        np.testing.assert_array_equal(f["x_train"], images)
        assert f["x_test"].shape[1:] == (28, 28)
    raw = tmp_path / "examples/pytorch/data/MNIST/raw/train-images-idx3-ubyte"
    data = raw.read_bytes()
    assert data[:4] == b"\x00\x00\x08\x03" and int.from_bytes(data[4:8], "big") == len(images)
    assert np.frombuffer(data[16:], np.uint8).reshape(images.shape).tolist() == images.tolist()
    with gzip.open(str(raw) + ".gz") as f:
        assert f.read() == data
    with zipfile.ZipFile(tmp_path / "examples/mxnet/data-0/mnist.zip") as z:
        assert z.read("train-labels-idx1-ubyte")[8:] == labels.tobytes()
