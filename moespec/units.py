"""Byte counts as users read them (decimal units, as link bandwidths are quoted in GB/s).

No moespec imports: the base modules (fsutil's disk-full line) use it as well as the commands.
"""

from __future__ import annotations


def _decimal_bytes(n: int, below: float, fmt: str) -> str:
    """``n`` bytes in the largest decimal unit that keeps the value under ``below``, as ``fmt``."""
    value = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(value) < below or unit == "TB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:{fmt}} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def format_bytes(n: int) -> str:
    """``3623878656`` -> ``3.62 GB`` (decimal units, as link bandwidths are quoted in GB/s)."""
    return _decimal_bytes(n, 1000, ".2f")


def format_bytes_short(n: int) -> str:
    """``n`` bytes with 3 significant digits, for narrow table columns: ``702 MB``, ``66.4 MB``, ``6.14 kB``."""
    return _decimal_bytes(n, 999.5, ".3g")  # 999.5 rounds to 1e3 at 3 digits: the next unit instead
