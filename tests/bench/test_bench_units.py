"""Sizes, tc link rates and durations: parsing and formatting."""

from __future__ import annotations

import pytest

from hora.bench.units import (
    fmt_bytes,
    fmt_rate,
    fmt_ratio,
    fmt_seconds,
    parse_duration,
    parse_rate,
    parse_size,
    parse_sizes,
)
from hora.errors import ConfigError


@pytest.mark.parametrize("text, n", [("4KiB", 4096), ("64K", 65536), ("1MiB", 1 << 20), ("16MB", 16 << 20),
                                     ("1G", 1 << 30), ("4096", 4096), (" 2 MiB ", 2 << 20), (512, 512)])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text, match", [("4XB", "unknown unit"), ("abc", "cannot read"), ("0", "positive"),
                                         ("1.5", "whole")])
def test_parse_size_errors(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_size(text)


def test_parse_sizes_multiple_of_4():
    assert parse_sizes("4KiB,64KiB", multiple_of=4) == [4096, 65536]
    with pytest.raises(ConfigError, match="multiple of 4"):
        parse_sizes("6", multiple_of=4)
    with pytest.raises(ConfigError, match="no sizes"):
        parse_sizes(" , ")


@pytest.mark.parametrize("text, bps", [("1gbit", 1e9), ("10gbit", 1e10), ("25gbit", 2.5e10), ("100mbit", 1e8),
                                       ("1.5Gbit", 1.5e9), ("1kibit", 1024), ("1gbps", 8e9), ("10mbps", 8e7),
                                       (5e9, 5e9)])
def test_parse_rate_tc_units(text, bps):
    assert parse_rate(text) == pytest.approx(bps)


@pytest.mark.parametrize("text", ["1 parsec", "fast", "0gbit", "-1gbit"])
def test_parse_rate_errors(text):
    with pytest.raises(ConfigError):
        parse_rate(text)


@pytest.mark.parametrize("text, s", [("0.1ms", 1e-4), ("100us", 1e-4), ("100µs", 1e-4), ("1s", 1.0), ("2", 2.0),
                                     ("50ns", 5e-8), ("0", 0.0)])
def test_parse_duration(text, s):
    assert parse_duration(text) == pytest.approx(s)


def test_parse_duration_errors():
    with pytest.raises(ConfigError, match="unknown unit"):
        parse_duration("3 fortnights")


def test_formatting():
    assert fmt_bytes(4096) == "4 KiB" and fmt_bytes(1 << 28) == "256 MiB" and fmt_bytes(1536) == "1.5 KiB"
    assert fmt_rate(25e9) == "25 Gbit/s"
    assert fmt_seconds(0.0123) == "12.30 ms" and fmt_seconds(None) == "—" and fmt_seconds(0) == "0"
    assert fmt_ratio(1.234) == "1.23x" and fmt_ratio(None) == "—"
