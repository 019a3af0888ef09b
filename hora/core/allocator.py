"""Steadier memory for training loops: fixed glibc malloc thresholds.

A training step frees and reallocates the same multi-megabyte tensors every
step (gradients set to ``None`` by ``zero_grad()``, activations, a backend's
temporary buffers).  glibc serves blocks above its mmap threshold with a
fresh ``mmap`` and returns them with ``munmap``; below it, it returns free
memory at the top of the heap to the system once more than the trim
threshold is free.  Both thresholds move at run time, and whether a step's
tensors land in reused heap memory or in fresh pages depends on the order of
the allocations before it.  Fresh pages fault on first touch: measured on the
MLP benchmark, 1,100-3,200 page faults per step in a 2-rank job (and up to
1,100 in a single process), which made a step 25-40% slower than the same
step with 1-4 faults (docs/benchmarks.md).

:func:`tune_malloc` fixes the thresholds where glibc's own dynamic rule
ends up at its limit (mmap from 32 MiB, trim above 64 MiB free), so tensors
of up to 32 MiB are reused from the heap.  It is what PyTorch's CPU
performance guide gets by preloading jemalloc or tcmalloc, without a
preload.  It changes nothing when the user already chose: any ``MALLOC_*_``
variable, ``glibc.malloc`` tunables, or another allocator in ``LD_PRELOAD``.
"""

from __future__ import annotations

import ctypes
import logging
import platform
from collections.abc import Mapping

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20

# mallopt() parameter numbers from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_USER_CHOICES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")

_applied = False


def why_not_tune(env: Mapping[str, str]) -> str | None:
    """The reason to leave malloc alone in this process, or None to tune it."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "not glibc"
    chosen = [name for name in _USER_CHOICES if name in env]
    if chosen:
        return f"{chosen[0]} is set"
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets glibc.malloc"
    preload = env.get("LD_PRELOAD", "")
    other = next((a for a in _OTHER_ALLOCATORS if a in preload), None)
    if other:
        return f"{other} is preloaded"
    return None


def tune_malloc(env: Mapping[str, str]) -> bool:
    """Fix glibc's mmap and trim thresholds for this process; True when they are (now or before).

    Call once, early (``hvd.init()`` does, unless ``HORA_MALLOC_TUNING=0``).
    """
    global _applied
    if _applied:
        return True
    reason = why_not_tune(env)
    if reason is not None:
        log.debug("hora: leaving malloc's thresholds alone (%s)", reason)
        return False
    try:
        libc = ctypes.CDLL(None)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(
            _M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    except (OSError, AttributeError) as e:  # pragma: no cover - a libc without mallopt
        log.debug("hora: mallopt unavailable: %s", e)
        return False
    _applied = ok
    log.debug("hora: malloc mmap threshold %d, trim threshold %d: %s", MMAP_THRESHOLD, TRIM_THRESHOLD,
              "set" if ok else "refused")
    return ok
