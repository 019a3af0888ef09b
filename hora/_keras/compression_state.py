"""A stateful compressor's state in checkpoints and elastic commits, for the TensorFlow and Keras bindings.

A stateful compressor (PowerSGD, error feedback) keeps per-parameter state:
the step counter, each rank's residuals and PowerSGD's warm-start factors.
Its ``state_dict()`` is a nest of plain values and arrays (NumPy on
TensorFlow, torch tensors on Keras's torch backend).  This module turns it
into bytes without pickle (an ``.npz`` whose index is JSON), which is what
Keras's ``save_assets`` and TensorFlow's ``PythonState`` store, and keeps it
across elastic commits: a commit copies it, a restore loads the copy, and a
sync after a new rendezvous takes rank 0's step and factors while every
rank's residuals start from zero (:meth:`TensorStateCompressor.load_shared_state_dict`).
"""

from __future__ import annotations

import io
import json
import os
from typing import Any

import numpy as np

from hora.core import runtime
from hora.core.compression import is_stateful
from hora.core.objects import broadcast_object

#: the file a distributed Keras optimizer writes in its assets folder of a ``.keras`` archive.
ASSET_FILE = "hora_compression.npz"


def state_name(index: int, variable: Any = None) -> str:
    """The name a gradient's compressor state is kept under: its position and its variable's last two path parts.

    Keras puts the model's own scope in front of a variable's path when a
    script builds the model ("sequential/dense/kernel") but not when
    ``load_model`` rebuilds it ("dense/kernel"): the layer and the variable's
    own name, with the position, name it the same way in both.
    """
    if variable is None:
        return f"grad.{index}"
    path = str(getattr(variable, "path", None) or getattr(variable, "name", "var"))
    return f"{index}.{'/'.join(path.split('/')[-2:])}"


def _host(a: Any) -> np.ndarray:
    """An array of a state dict (NumPy or torch) as a NumPy array, bfloat16 widened to float32."""
    if type(a).__module__.split(".", 1)[0] == "torch":
        a = a.detach().cpu()
        if str(a.dtype) == "torch.bfloat16":
            a = a.float()
        return a.numpy()
    return np.asarray(a)


def state_to_bytes(state: dict[str, Any]) -> bytes:
    """A compressor's ``state_dict()`` as bytes: an ``.npz`` of its arrays plus a JSON index, no pickle."""
    index, arrays = [], {}
    for name, entries in state.get("tensors", {}).items():
        for key, value in entries.items():
            arrays[f"a{len(index)}"] = _host(value)
            index.append([name, key])
    meta = {k: v for k, v in state.items() if k != "tensors"}
    meta["index"] = index
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    out = io.BytesIO()
    np.savez(out, **arrays)
    return out.getvalue()


def state_from_bytes(data: bytes) -> dict[str, Any]:
    """The state dict that :func:`state_to_bytes` wrote (arrays as NumPy; the compressor casts them on load).

    Raises:
        ValueError: ``data`` is not such a state.
    """
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            meta = json.loads(npz["meta"].tobytes().decode())
            tensors: dict[str, dict[str, np.ndarray]] = {}
            for i, (name, key) in enumerate(meta.pop("index")):
                tensors.setdefault(name, {})[key] = npz[f"a{i}"]
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"not a saved hora compression state: {e}") from e
    return {**meta, "tensors": tensors}


def save_to_dir(compressor: Any, directory: str) -> None:
    """Write ``compressor``'s state to ``directory/ASSET_FILE`` (nothing for a stateless compressor)."""
    if is_stateful(compressor):
        with open(os.path.join(directory, ASSET_FILE), "wb") as f:
            f.write(state_to_bytes(compressor.state_dict()))


def read_dir(directory: str) -> dict[str, Any] | None:
    """The state :func:`save_to_dir` wrote to ``directory``, or None where it wrote none."""
    path = os.path.join(directory, ASSET_FILE)
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return state_from_bytes(f.read())


class ElasticCompression:
    """Elastic commits of one stateful compressor: what a ``KerasState`` or ``TensorFlowState`` does with it.

    ``save`` copies the state, ``restore`` loads the copy back (residuals
    included when this rank saved them in the same world), and ``sync``
    gives every rank rank 0's step and factors, with residuals from zero.
    """

    def __init__(self, compressor: Any, tag: str) -> None:
        self.compressor = compressor
        self.tag = tag
        self.saved = compressor.state_dict()

    def save(self) -> None:
        self.saved = self.compressor.state_dict()

    def restore(self) -> None:
        self.compressor.load_state_dict(self.saved)

    def sync(self) -> None:
        c = self.compressor
        is_root = runtime.current().engine.rank == 0
        # A custom compressor without the shared variants sends and takes its whole state.
        share = getattr(c, "shared_state_dict", c.state_dict)
        shared = broadcast_object(share() if is_root else None, 0, name=f"elastic.compression.{self.tag}")
        getattr(c, "load_shared_state_dict", c.load_state_dict)(shared)
        self.saved = c.state_dict()


def split_compressors(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Take the stateful compressors out of an elastic state's keyword arguments (they are kept by reference).

    ``ObjectState`` deep-copies and broadcasts its attributes, which would cut
    a compressor off from the optimizer or tape that uses it and hand every
    rank rank 0's residuals; such values are kept by :class:`ElasticCompression`.
    """
    found = {k: v for k, v in kwargs.items() if is_stateful(v)}
    for k in found:
        del kwargs[k]
    return found


__all__ = ["ASSET_FILE", "ElasticCompression", "read_dir", "save_to_dir", "split_compressors", "state_from_bytes",
           "state_name", "state_to_bytes"]
