"""Fused float32 update loops in C, built from ``fused.c`` on first use; the NumPy rules stay the reference.

A NumPy rule makes one pass over the key per operation: Adam's fourteen
passes cost about three times SGD's update, which on a host whose cores the
workers share is step time (docs/benchmarks.md, issue 30).  The C loop makes
the same operations in the same order, rounded the same way, in one pass.
It is compiled with the host's C compiler (``$CC``, else ``cc``) into a
per-user cache, once per source and compiler, and loaded with ctypes; the
optimizer then checks it against its NumPy rule on a probe before trusting
it (:mod:`hora.kvstore.optimizer.adaptive`).  Without a compiler, with a
failed build or check, or with ``HORA_PS_FUSED=0``, the NumPy rules run:
nothing needs compiling for hora to work.
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
from pathlib import Path

from hora import envvars

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("fused.c")
#: No fused multiply-add and no fast-math: every operation rounds as the NumPy rule's does.
FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC")

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}

_F, _P = ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    "hora_adam_f32": (_P, _P, _P, _P, ctypes.c_long, _F, _F, ctypes.c_int, _F, _F, _F, _F, _F, _F, _F),
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
    fn.argtypes, fn.restype = _SIGNATURES[name], None
    return fn


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


__all__ = ["function", "enabled", "SOURCE", "FLAGS"]
