"""Record MXNet 1.9.1's optimizer results for the main venv's bit-for-bit tests (run in .venv-mxnet).

    PYTHONPATH=. .venv-mxnet/bin/python tests/kvstore/record_mxnet_optimizers.py

writes ``tests/kvstore/data/mxnet_optimizers.npz``: per case, the spec hora's
converter made of MXNet's optimizer, a digest of the inputs (so a change in
NumPy's random stream shows as such, not as a wrong update), and MXNet's
weights after every step of every key, end to end in one array (:func:`flatten`).
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.kvstore import mxnet_optimizer_cases as cases  # noqa: E402

OUT = Path(__file__).with_name("data") / "mxnet_optimizers.npz"


def main() -> None:
    """Run every case through MXNet and write the file."""
    import mxnet as mx

    import hora.mxnet  # noqa: F401  (the converter lives beside the stores)

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    arrays: dict[str, np.ndarray] = {"mxnet_version": np.array(mx.__version__)}
    for case in cases.CASES:
        name = case["name"]
        arrays[f"{name}/spec"] = np.array(json.dumps(cases.hora_spec(case)))
        arrays[f"{name}/inputs"] = np.array(cases.input_digest(case))
        arrays[f"{name}/out"] = cases.flatten(cases.run_mxnet(case))
    OUT.parent.mkdir(exist_ok=True)
    np.savez_compressed(OUT, **arrays)
    print(f"wrote {len(cases.CASES)} cases to {OUT}")


if __name__ == "__main__":
    main()
