"""Byte units. remat prints decimal gigabytes (1 GB = 1e9 bytes) unless a label says GiB."""

from __future__ import annotations

BYTES_PER_GB = 1_000_000_000
BYTES_PER_MIB = 1 << 20


def gb_to_bytes(gb: float) -> int:
    return int(round(gb * BYTES_PER_GB))


def format_bytes(num_bytes: float) -> str:
    """``1234567`` -> ``"1.23 MB"``; decimal units, always labelled."""
    value = float(num_bytes)
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{int(value)} B"


def format_seconds(seconds: float) -> str:
    if abs(seconds) >= 1.0:
        return f"{seconds:.2f} s"
    if abs(seconds) >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"
