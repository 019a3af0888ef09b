"""Reading and writing the quantities of a benchmark: bytes, link rates, latencies, durations.

Sizes use binary units (``4KiB``, ``64MiB``; ``K``/``M``/``G`` are read as
KiB/MiB/GiB, as in the allreduce benchmark).  Link rates use ``tc``'s units,
so the same string shapes an emulated link and feeds the cost model:
``bit``, ``kbit``, ``mbit``, ``gbit``, ``tbit`` are bits per second in SI
(``1gbit`` = 10**9 bit/s) and ``kibit``... are binary; ``bps``, ``kbps``,
``mbps``, ``gbps`` are *bytes* per second, as in ``tc`` (``1gbps`` = 8 gbit).
Latencies take ``s``, ``ms``, ``us`` (or ``µs``) and ``ns``.
"""

from __future__ import annotations

import math
import re

from hora.errors import ConfigError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

_SIZE_UNITS = {"": 1, "b": 1, "k": KiB, "kb": KiB, "kib": KiB, "m": MiB, "mb": MiB, "mib": MiB,
               "g": GiB, "gb": GiB, "gib": GiB}
# multiplier to bits per second
_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "kibit": 2.0**10, "mibit": 2.0**20, "gibit": 2.0**30, "tibit": 2.0**40,
               "bps": 8.0, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}
_TIME_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "µs": 1e-6, "usec": 1e-6,
               "ns": 1e-9}


def _split(text: str, what: str, example: str) -> tuple[float, str]:
    m = re.fullmatch(r"\s*((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)\s*([A-Za-zµ]*)\s*", str(text))
    if not m:
        raise ConfigError(f"cannot read {what} {text!r}: write a number and a unit, e.g. {example}")
    return float(m.group(1)), m.group(2).lower()


def parse_size(text: str | int, *, multiple_of: int = 1) -> int:
    """``"64MiB"`` / ``"4K"`` / ``4096`` -> bytes (binary units).

    Raises:
        ConfigError: not a size, not positive, or not a multiple of ``multiple_of``
            (4 for float32 payloads).
    """
    if isinstance(text, int):
        value, unit = float(text), ""
    else:
        value, unit = _split(text, "size", "4KiB, 64MiB or 4096")
    if unit not in _SIZE_UNITS:
        raise ConfigError(f"size {text!r}: unknown unit {unit!r}; use B, KiB, MiB or GiB")
    n = value * _SIZE_UNITS[unit]
    if n != int(n) or n <= 0:
        raise ConfigError(f"size {text!r} is not a positive whole number of bytes")
    if int(n) % multiple_of:
        raise ConfigError(f"size {text!r} = {int(n)} bytes is not a multiple of {multiple_of}")
    return int(n)


def parse_sizes(text: str, *, multiple_of: int = 1) -> list[int]:
    """A comma-separated list of sizes, e.g. ``"4KiB,64KiB,1MiB"``."""
    sizes = [parse_size(s, multiple_of=multiple_of) for s in text.split(",") if s.strip()]
    if not sizes:
        raise ConfigError(f"no sizes in {text!r}: give a comma-separated list such as 4KiB,1MiB")
    return sizes


def parse_rate(text: str | float) -> float:
    """A link rate in ``tc``'s units -> bits per second (``"25gbit"`` -> ``25e9``).

    Raises:
        ConfigError: not a rate, or not positive.
    """
    if isinstance(text, (int, float)):
        bps = float(text)
    else:
        value, unit = _split(text, "link rate", "1gbit, 10gbit or 100mbit")
        if unit not in _RATE_UNITS:
            raise ConfigError(f"link rate {text!r}: unknown unit {unit!r}; use tc's units: "
                              "bit, kbit, mbit, gbit (bits/s) or bps, mbps, gbps (bytes/s)")
        bps = value * _RATE_UNITS[unit]
    if not bps > 0 or math.isinf(bps):
        raise ConfigError(f"link rate {text!r} must be a positive, finite number of bits per second")
    return bps


def parse_duration(text: str | float) -> float:
    """A latency or time -> seconds (``"0.1ms"`` -> ``1e-4``; a bare number is seconds).

    Raises:
        ConfigError: not a duration, or negative.
    """
    if isinstance(text, (int, float)):
        seconds = float(text)
    else:
        value, unit = _split(text, "duration", "0.1ms, 50us or 1s")
        if unit == "":
            unit = "s"
        if unit not in _TIME_UNITS:
            raise ConfigError(f"duration {text!r}: unknown unit {unit!r}; use s, ms, us or ns")
        seconds = value * _TIME_UNITS[unit]
    if seconds < 0 or math.isinf(seconds) or seconds != seconds:
        raise ConfigError(f"duration {text!r} must be a finite number >= 0")
    return seconds


def fmt_bytes(n: float) -> str:
    """``4096`` -> ``4 KiB``; ``1 << 28`` -> ``256 MiB``; other values with one decimal."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            q = n / scale
            return f"{q:.0f} {unit}" if q == int(q) else f"{q:.1f} {unit}"
    return f"{n:.0f} B"


def fmt_rate(bits_per_s: float) -> str:
    """``25e9`` -> ``25 Gbit/s``."""
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:.3g} {unit}"
    return f"{bits_per_s:.3g} bit/s"


def fmt_seconds(s: float | None) -> str:
    """Seconds with a unit that keeps 3-4 significant digits; an em dash for missing values."""
    if s is None or s != s:
        return "—"
    if s == 0:
        return "0"
    if abs(s) < 1e-3:
        return f"{s * 1e6:.1f} µs"
    if abs(s) < 1.0:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.3f} s"


def fmt_ratio(x: float | None) -> str:
    """A ratio such as ``1.23x``, or an em dash."""
    if x is None or x != x or math.isinf(x):
        return "—"
    return f"{x:.2f}x"
