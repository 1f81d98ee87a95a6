"""Byte units. remat prints decimal gigabytes (1 GB = 1e9 bytes) unless a label says GiB.

A budget figure a message asks the user to pass is printed rounded *up* (``format_gb_up``), so
that passing the printed number back is never a byte short of what was named.
"""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction

BYTES_PER_GB = 1_000_000_000
GB_SIGNIFICANT_DIGITS = 4       # a budget printed in GB shows at least this many significant digits
GB_MIN_DECIMALS = 4             # ... and at least this many decimals (0.0300 GB, 1.0000 GB)


def gb_to_bytes(gb: float) -> int:
    """Decimal GB to whole bytes, rounded to the nearest byte. Exact for every finite float,
    however large (``1e308`` GB is a 318-digit int, not an ``OverflowError``)."""
    return round(Fraction(gb) * BYTES_PER_GB)


def format_gb_up(num_bytes: int) -> str:
    """``num_bytes`` as decimal GB, rounded *up*, e.g. ``107_140`` -> ``"0.0001072"``.

    Guarantees: ``gb_to_bytes(float(result)) >= num_bytes``, so a budget printed this way and
    passed back as ``budget_gb`` is at least ``num_bytes``; it shows at least
    ``GB_SIGNIFICANT_DIGITS`` significant digits and ``GB_MIN_DECIMALS`` decimals, never more
    than 9 decimals (a whole byte), and is at most one unit of its last digit above ``num_bytes``.
    """
    num_bytes = max(int(num_bytes), 0)
    digits = len(str(num_bytes)) if num_bytes > 0 else 1
    unit_exponent = min(max(digits - GB_SIGNIFICANT_DIGITS, 0), 9 - GB_MIN_DECIMALS)
    unit = 10 ** unit_exponent
    decimals = 9 - unit_exponent
    rounded = -(-num_bytes // unit) * unit
    while True:
        text = f"{rounded // BYTES_PER_GB}.{rounded % BYTES_PER_GB:09d}"[: -unit_exponent or None]
        as_float = float(text)
        if as_float == float("inf") or gb_to_bytes(as_float) >= num_bytes:   # parsing can land short on huge figures
            assert len(text.split(".")[1]) == decimals
            return text
        rounded += unit


def format_bytes(num_bytes: float) -> str:
    """``1234567`` -> ``"1.23 MB"``; decimal units, always labelled. Any int, however large
    (a budget of ``1e308`` GB is ``"1.00e+308 GB"``)."""
    if isinstance(num_bytes, int) and abs(num_bytes) >= 10**18:   # an exabyte and up: no float on the way
        return f"{Decimal(num_bytes).scaleb(-9):.2e} GB"
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
