"""hora: data-parallel training with Horovod's API and MXNet's KVStore API.

``import hora`` stays light: the launcher's Python API, :func:`hora.run`, is
imported only when first used, and nothing in :mod:`hora.core` imports the
runner.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "run":
        from hora.runner.api import run

        return run
    raise AttributeError(f"module 'hora' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), "run"])
