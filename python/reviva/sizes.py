"""Byte sizes as users write them ("24GB", "512MiB", 1 << 30)."""

from __future__ import annotations

import math
import re
from decimal import Decimal

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


def format_bytes(n: int) -> str:
    """A byte count for messages: GB from 1 GB up, MB below (decimal units, as budgets are
    usually written)."""
    return f"{n / 1e9:.2f} GB" if abs(n) >= 1e9 else f"{n / 1e6:.1f} MB"


def parse_bytes(value: int | float | str) -> int:
    """Returns a byte count from an int, or a string with a decimal (GB) or binary (GiB) unit.

    Raises ValueError naming the value when it is not a non-negative size.
    """
    if isinstance(value, bool):
        raise TypeError(f"a byte size must be an int or a string like '24GB', got {value!r}")
    if isinstance(value, int | float):
        if value < 0 or not math.isfinite(value) or value != int(value):
            raise ValueError(f"a byte size must be a whole number >= 0, got {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise TypeError(f"a byte size must be an int or a string like '24GB', got {value!r}")
    match = _PATTERN.match(value)
    if not match or match.group(2).upper() not in _UNITS:
        raise ValueError(
            f"cannot read {value!r} as a byte size: use a number with one of the units "
            f"B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. '24GB')"
        )
    # Decimal, not float: "2.01KB" is exactly 2010 bytes, not 2009.9999...
    size = Decimal(match.group(1)) * _UNITS[match.group(2).upper()]
    if size != size.to_integral_value():
        raise ValueError(f"{value!r} is not a whole number of bytes ({size})")
    return int(size)
