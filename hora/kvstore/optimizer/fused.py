"""Fused float32 update loops in C, built from ``fused.c`` on first use; the NumPy rules stay the reference.

A NumPy rule makes one pass over the key per operation (Adam's fourteen
passes cost about three times SGD's update), and MXNet's sequential float32
sum of squares (LAMB's norms) is no single NumPy operation.  On a host whose
cores the workers share, that CPU time is step time (docs/benchmarks.md,
issue 30).  The C loops make the same operations in the same order, rounded
the same way, in one pass.  They are compiled with the host's C compiler
(``$CC``, else ``cc``) into a per-user cache, once per source and compiler,
and loaded with ctypes; each optimizer checks its loop against its NumPy
rule on a probe before trusting it.  Without a compiler, after a failed
build or probe, or with ``HORA_PS_FUSED=0``, the NumPy rules run: nothing
needs compiling for hora to work.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from hora import envvars

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("fused.c")
#: No fused multiply-add and no fast-math: every operation rounds as the NumPy rule's does.
FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC")

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}

_F, _P, _I, _N = ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_long
_SIGNATURES = {  # name: (argument types, result type)
    "hora_adam_f32": ((_P, _P, _P, _P, _N, _F, _F, _I, _F, _F, _F, _F, _F, _F, _F), None),
    "hora_adagrad_f32": ((_P, _P, _P, _N, _F, _F, _F, _F), None),
    "hora_sum_sq_f32": ((_P, _N), _F),
    "hora_lamb_direction_f32": ((_P, _P, _P, _P, _P, _N, _F, _I, _F, _F, _F, _F, _F, _I, _F, _F, ctypes.c_double,
                                 _F), None),
}


def enabled() -> bool:
    """False when ``HORA_PS_FUSED`` is ``0`` (or ``false``/``no``/``off``): the NumPy rules only."""
    return os.environ.get(envvars.HORA_PS_FUSED, "1").strip().lower() not in ("0", "false", "no", "off")


def function(name: str) -> ctypes._CFuncPtr | None:
    """The C loop ``name`` of ``fused.c``, built and loaded once per process; None where it cannot be."""
    if not enabled():
        return None
    with _lock:
        if "lib" not in _loaded:
            try:
                _loaded["lib"] = _build()
            except Exception as e:  # no compiler, a read-only cache, a failed build: the NumPy rules run
                log.info("hora: fused optimizer loops unavailable (%s: %s); NumPy rules run", type(e).__name__, e)
                _loaded["lib"] = None
        lib = _loaded["lib"]
    if lib is None:
        return None
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = _SIGNATURES[name]
    return fn


_checked: dict[tuple[str, ...], tuple[ctypes._CFuncPtr, ...] | None] = {}


def checked(names: tuple[str, ...], probe: Callable[[tuple[ctypes._CFuncPtr, ...]], bool]
            ) -> tuple[ctypes._CFuncPtr, ...] | None:
    """The C loops ``names``, once ``probe(loops)`` has found that they give the NumPy rule's bits (asked
    once per process); None when turned off, unavailable, or refused by the probe (with a warning)."""
    if not enabled():
        return None
    with _lock:
        if names in _checked:
            return _checked[names]
    loops = tuple(function(name) for name in names)
    ok = all(fn is not None for fn in loops)
    if ok and not probe(loops):  # type: ignore[arg-type]
        log.warning("hora: the fused loops %s built from %s do not give the NumPy rule's bits; NumPy runs instead",
                    ", ".join(names), SOURCE.name)
        ok = False
    with _lock:
        return _checked.setdefault(names, loops if ok else None)  # type: ignore[arg-type]


def probe_data(steps: int = 2, n: int = 4099) -> tuple[np.ndarray, list[np.ndarray]]:
    """A weight and ``steps`` gradients for a probe: normals over 23 decades, then NaN, infinities, signed
    zeros, subnormals and large values (whose squares stay finite, for sums on threads NumPy's error state
    does not reach) at the weight's start and the first gradient's end."""
    rng = np.random.default_rng(0)
    special = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e-45, -1e-45, 1e18, -1e-30], np.float32)
    weight = (rng.standard_normal(n) * 3).astype(np.float32)
    grads = [(rng.standard_normal(n) * 10 ** rng.uniform(-20, 3, n)).astype(np.float32) for _ in range(steps)]
    weight[1:special.size + 1], grads[0][-special.size:] = special, special
    return weight, grads


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two float32 arrays hold the same bits, a NaN matching any NaN: the sign of a NaN that an
    operation makes differs between NumPy versions (and their SIMD loops), and is no part of the result."""
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b)) and np.array_equal(a.view(np.uint32)[~nan], b.view(np.uint32)[~nan]))


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hora" / "kernels"


def _build() -> ctypes.CDLL | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise FileNotFoundError("no C compiler (set CC, or install cc)")
    source = SOURCE.read_bytes()
    tag = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), cc.encode(),
                                     platform.machine().encode()])).hexdigest()[:16]
    target = _cache_dir() / f"fused-{tag}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        os.close(fd)
        try:
            subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], check=True, capture_output=True,
                           timeout=120)
            os.replace(tmp, target)  # atomic: processes building at once each publish a whole library
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(target))


__all__ = ["function", "checked", "enabled", "probe_data", "same_bits", "SOURCE", "FLAGS"]
