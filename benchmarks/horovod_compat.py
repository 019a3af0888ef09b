"""Rebuild the scratch copy in which Horovod's own examples and elastic tests run against hora (docs/horovod-compat.md).

Nothing of Horovod lives in this repository: this script takes a Horovod
checkout (``git clone https://github.com/horovod/horovod; git checkout v0.28.1``)
and writes, under ``--out``, outside this repository:

* ``examples/`` and ``test/``: Horovod's files with only their imports
  changed (``import horovod.X as hvd`` -> ``import hora.X as hvd``,
  ``import horovod`` -> ``import hora as horovod``, ``from horovod.X`` ->
  ``from hora.X``); the test harness files (``test/integration/elastic_common.py``,
  ``test/utils/common.py``) keep even their imports;
* ``standin/horovod``: what the test harness imports from Horovod's runner,
  written here: ``_run_elastic(args)`` runs the same command line with
  ``hora run`` in place of ``horovodrun``, and raises ``RuntimeError`` when
  the job fails, as Horovod's Python launcher does;
* ``bin/discover-localhost2.sh``: the elastic examples' host discovery;
* ``shim/sitecustomize.py``: two workarounds for this machine's packages,
  not for hora (PyPI's torchvision is the CUDA build; Keras checks a
  downloaded file's hash, which offline data cannot match);
* offline data of MNIST's shapes (scikit-learn's 8x8 digits, enlarged to
  28x28 uint8) where each script looks: Keras's cache
  (``<out>/home/.keras/datasets/mnist*.npz``; run with ``HOME=<out>/home``), torchvision's raw IDX files
  (``data/MNIST/raw``), MXNet's ``data-<rank>/mnist.zip``; and a small
  ImageFolder of random JPEGs for the ImageNet scripts' ``--train-dir``.

Run::

    python benchmarks/horovod_compat.py --horovod /path/to/horovod --out /tmp/hvd-compat
"""

from __future__ import annotations

import argparse
import gzip
import io
import re
import shutil
import struct
import zipfile
from pathlib import Path

import numpy as np

EXAMPLE_DIRS = ("pytorch", "tensorflow2", "keras", "mxnet", "elastic")
TEST_FILES = ("test/single/test_torch_elastic.py", "test/integration/data/elastic_torch_main.py")
HARNESS_FILES = ("test/integration/elastic_common.py", "test/integration/test_elastic_torch.py",
                 "test/utils/common.py")

_IMPORTS = [
    (re.compile(r"^(\s*)import horovod\.(\S+) as (\w+)", re.M), r"\1import hora.\2 as \3"),
    (re.compile(r"^(\s*)import horovod\s*$", re.M), r"\1import hora as horovod"),
    (re.compile(r"^(\s*)from horovod\.", re.M), r"\1from hora."),
]


def change_imports(text: str) -> str:
    """Horovod's imports of a script turned into hora's; nothing else changes."""
    for pattern, replacement in _IMPORTS:
        text = pattern.sub(replacement, text)
    return text


# --------------------------------------------------------------------- data

def digits_28x28() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1797 digits, 8x8 in 0..16, enlarged to 28x28 uint8 in 0..255 (MNIST's shape and range)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    small = digits.images.astype(np.float32) / 16.0
    # 8 -> 24 by repeating each pixel 3x3, then a 2-pixel border as in MNIST's centred digits.
    big = np.repeat(np.repeat(small, 3, axis=1), 3, axis=2)
    images = np.zeros((len(big), 28, 28), dtype=np.uint8)
    images[:, 2:26, 2:26] = np.round(big * 255.0).astype(np.uint8)
    return images, digits.target.astype(np.uint8)


def _idx(array: np.ndarray) -> bytes:
    kind = 0x08  # unsigned byte
    header = struct.pack(">HBB", 0, kind, array.ndim) + b"".join(struct.pack(">I", d) for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


IDX_NAMES = {"train_images": "train-images-idx3-ubyte", "train_labels": "train-labels-idx1-ubyte",
             "test_images": "t10k-images-idx3-ubyte", "test_labels": "t10k-labels-idx1-ubyte"}


def write_data(out: Path, ranks: int) -> dict[str, np.ndarray]:
    """Write the offline MNIST stand-in in each framework's format; returns the arrays."""
    images, labels = digits_28x28()
    split = 1500
    parts = {"train_images": images[:split], "train_labels": labels[:split],
             "test_images": images[split:], "test_labels": labels[split:]}
    # Keras: mnist.load_data(path=...) reads ~/.keras/datasets/<path> (tf_keras ignores $KERAS_HOME), an npz of
    # x_train, y_train, x_test, y_test: the runs set HOME=<out>/home.
    keras_dir = out / "home" / ".keras" / "datasets"
    keras_dir.mkdir(parents=True, exist_ok=True)
    names = ["mnist.npz"] + [f"mnist-{r}.npz" for r in range(ranks)]
    for name in names:
        np.savez(keras_dir / name, x_train=parts["train_images"], y_train=parts["train_labels"],
                 x_test=parts["test_images"], y_test=parts["test_labels"])
    # torchvision: MNIST(root) finds root/MNIST/raw/<idx file>, uncompressed; the scripts' root is ./data.
    for where in ("examples/pytorch", "examples/elastic/pytorch"):
        raw = out / where / "data" / "MNIST" / "raw"
        raw.mkdir(parents=True, exist_ok=True)
        for key, name in IDX_NAMES.items():
            (raw / name).write_bytes(_idx(parts[key]))
            with gzip.open(raw / f"{name}.gz", "wb") as f:
                f.write(_idx(parts[key]))
    # MXNet: data-<rank>/mnist.zip holding the four IDX files (the scripts skip the download when it exists).
    for r in range(ranks):
        d = out / "examples" / "mxnet" / f"data-{r}"
        d.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(d / "mnist.zip", "w") as z:
            for key, name in IDX_NAMES.items():
                z.writestr(name, _idx(parts[key]))
    return parts


def write_image_folder(root: Path, classes: int = 4, per_class: int = 8, size: int = 64) -> None:
    """A tiny ImageFolder (train/ and val/) of random RGB JPEGs for the ImageNet scripts' --train-dir/--val-dir."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in range(classes):
            d = root / split / f"class{c}"
            d.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                pixels = rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)
                buf = io.BytesIO()
                Image.fromarray(pixels).save(buf, format="JPEG")
                (d / f"{i}.jpg").write_bytes(buf.getvalue())


# ------------------------------------------------------------ stand-ins

SITECUSTOMIZE = '''"""Workarounds for this machine's packages, outside hora (see benchmarks/horovod_compat.py)."""
import importlib.abc
import importlib.util
import os
import sys


def _torchvision_schemas():
    # PyPI's torchvision 0.28.0 is the CUDA build: beside the CPU torch its compiled ops do not load, and its
    # import then fails registering fake kernels for two ops nobody defined. Declaring their schemas lets the
    # pure-Python parts (datasets, transforms, models) import; the detection ops stay unavailable.
    import torch

    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    sys.modules[__name__].__dict__["_torchvision_lib"] = lib


def _accept_offline_files(module):
    # Keras compares a cached dataset's hash with the real download's; the offline stand-in written next to a
    # "<file>.offline" marker is accepted as it is, so load_data() reads it instead of downloading.
    original = module.validate_file

    def validate_file(fpath, file_hash, *args, **kwargs):
        if os.path.exists(str(fpath) + ".offline"):
            return True
        return original(fpath, file_hash, *args, **kwargs)

    module.validate_file = validate_file


class _After(importlib.abc.MetaPathFinder):
    hooks = {"keras.src.utils.file_utils": _accept_offline_files,
             "tf_keras.src.utils.data_utils": _accept_offline_files}

    def find_spec(self, name, path=None, target=None):
        if name not in self.hooks:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader, hook = spec.loader, self.hooks[name]

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                hook(module)

        spec.loader = Loader()
        return spec


sys.meta_path.insert(0, _After())
if os.environ.get("HVD_COMPAT_TORCHVISION") == "1":
    _torchvision_schemas()
'''

STANDIN = {
    "horovod/__init__.py": '"""Stand-in for the parts of Horovod\'s runner that its test harness imports."""\n',
    "horovod/runner/__init__.py": "",
    "horovod/runner/util/__init__.py": "",
    "horovod/runner/util/threads.py": '''import threading


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    thread = threading.Thread(target=target, args=args, name=name, daemon=daemon)
    thread.start()
    return thread
''',
    "horovod/runner/common/__init__.py": "",
    "horovod/runner/common/util/__init__.py": "",
    "horovod/runner/common/util/config_parser.py": '''def set_env_from_args(env, args):
    """hora run reads its own flags."""
    return env
''',
    "horovod/runner/elastic/__init__.py": "",
    "horovod/runner/elastic/constants.py": '''# hora run's message when the ring re-forms too often.
RESET_LIMIT_EXCEEDED_MESSAGE = "more than --reset-limit {}"
''',
    # Horovod's tests patch these two tunables of its own driver; hora's driver has its own (discovery every second).
    "horovod/runner/elastic/driver.py": "DISCOVER_HOSTS_FREQUENCY_SECS = 1.0\nELASTIC_TIMEOUT_SECS = 600\n",
    "horovod/runner/gloo_run.py": "def _get_min_start_hosts(settings):\n    return 1\n",
    "horovod/runner/launch.py": '''"""horovodrun's Python entry points, running the same command line with hora run."""
import os
import subprocess
import sys

FAILURE_MESSAGE = {failure_message!r}


def parse_args():
    return list(sys.argv[1:])


def _run_elastic(args):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                        if not p.endswith("standin"))
    proc = subprocess.run(["hora", "run", *args], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    sys.stdout.write(proc.stdout)
    if proc.returncode != 0:
        tail = "\\n".join(proc.stdout.splitlines()[-40:])
        raise RuntimeError(f"{{FAILURE_MESSAGE}} (hora run exited with {{proc.returncode}}):\\n{{tail}}")
''',
}


#: Horovod's test_elastic_torch.py skips four scenarios for Horovod's own bugs; this runs all eight on hora.
ALL_SCENARIOS = '''"""Every scenario of Horovod's elastic_common.BaseElasticTests with its torch training script
(written by benchmarks/horovod_compat.py)."""
import os
import unittest

from elastic_common import BaseElasticTests


class AllElasticTorchScenarios(BaseElasticTests, unittest.TestCase):
    def __init__(self, *args, **kwargs):
        script = os.path.join(os.path.dirname(__file__), "data", "elastic_torch_main.py")
        super().__init__(script, *args, **kwargs)
'''


def failure_message(horovod: Path) -> str:
    """The sentence Horovod's launcher raises with when a worker fails, read from the checkout's harness."""
    text = (horovod / "test/integration/elastic_common.py").read_text()
    match = re.search(r"message = '([^']+)'", text)
    return match.group(1) if match else "job failed"


def prepare(horovod: Path, out: Path, ranks: int) -> None:
    """Write the scratch copy (see the module docstring)."""
    out.mkdir(parents=True, exist_ok=True)
    for sub in EXAMPLE_DIRS:
        for src in sorted((horovod / "examples" / sub).rglob("*.py")):
            dst = out / src.relative_to(horovod)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_text(change_imports(src.read_text()))
    for rel in TEST_FILES:
        dst = out / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(change_imports((horovod / rel).read_text()))
    for rel in HARNESS_FILES:
        dst = out / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(horovod / rel, dst)
    (out / "test/integration/test_all_scenarios.py").write_text(ALL_SCENARIOS)
    standin = out / "standin"
    for rel, text in STANDIN.items():
        path = standin / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text.format(failure_message=failure_message(horovod)) if rel.endswith("launch.py")
                        else text)
    discover = out / "bin" / "discover-localhost2.sh"  # the elastic examples' host discovery
    discover.parent.mkdir(exist_ok=True)
    discover.write_text("#!/bin/sh\necho localhost:2\n")
    discover.chmod(0o755)
    shim = out / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(SITECUSTOMIZE)
    write_data(out, ranks)
    for npz in (out / "home" / ".keras" / "datasets").glob("*.npz"):
        Path(str(npz) + ".offline").write_text("offline stand-in of MNIST's shapes\n")
    write_image_folder(out / "imagenet")


def main() -> None:
    """Parse the flags and write the scratch copy."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--horovod", type=Path, required=True, help="a Horovod checkout (v0.28.1)")
    p.add_argument("--out", type=Path, required=True, help="the scratch directory, outside this repository")
    p.add_argument("--ranks", type=int, default=4, help="per-rank data copies to write (mnist-<rank>.npz, data-<rank>)")
    args = p.parse_args()
    prepare(args.horovod.resolve(), args.out.resolve(), args.ranks)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
