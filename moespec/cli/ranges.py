"""The allowed range of every numeric option, in one table, checked before any work starts.

``OPTIONS`` maps a flag to its :class:`Range` (``COMMAND_OPTIONS`` where one command gives a flag
another meaning); ``cli.common.register_command`` checks every numeric option of every command
against it before the command body runs, so a bad value never reaches a model load: NaN, ±inf,
out of range, and (through ``MoespecGroup``) a value of the wrong type are each one line naming the
flag and what it may hold. Model-dependent limits (the cache minimum, the context length, a group
size that must divide I×H) are checked later, once the model's config is read, as before.

This module imports nothing but moespec.errors: ``moespec serve`` may check request fields with the
same ranges (``OPTIONS["--temperature"].check("temperature", value)``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Union

from moespec.errors import OptionError

Number = Union[int, float]


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Range:
    """What one numeric option may hold.

    Attributes:
        kind: int (whole numbers) or float (finite numbers; NaN and ±inf never are).
        low, high: the bounds; ``high`` may be a function (e.g. of the cores), evaluated when checked.
        low_open, high_open: the bound itself is excluded (float bounds only).
        why: what the upper bound is, said in the message ("the cores this process may use").
        parse: for options given as text (``--gpu-memory 2GiB``, ``--prompt-len 64,128``): the
            numbers in it (raising OptionError for malformed text); None = the value itself.
        show: how a bound is written (default: ``1,048,576`` / ``0.5``).
    """

    kind: type
    low: Number
    high: Number | Callable[[], Number]
    low_open: bool = False
    high_open: bool = False
    why: str = ""
    parse: Callable[[str, str], list[Number]] | None = None
    show: Callable[[Number], str] | None = None

    def upper(self) -> Number:
        return self.high() if callable(self.high) else self.high

    def text(self) -> str:
        """The range as the messages say it: ``at least 1 and at most 2 (the cores ...)``."""
        why = f" ({self.why})" if self.why else ""
        if self.kind is int:
            show = self.show or "{:,}".format
            return f"at least {show(self.low)} and at most {show(self.upper())}{why}"
        lo = f"> {self.low:g}" if self.low_open else f">= {self.low:g}"
        hi = f"< {self.upper():g}" if self.high_open else f"<= {self.upper():g}"
        return f"a finite number {lo} and {hi}{why}"

    def contains(self, value: Number) -> bool:
        """True when ``value`` (a number) is in the range."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.kind is int and not float(value).is_integer():
            return False
        if not math.isfinite(value):
            return False
        low_ok = value > self.low if self.low_open else value >= self.low
        high_ok = value < self.upper() if self.high_open else value <= self.upper()
        return low_ok and high_ok

    def check(self, flag: str, value) -> None:
        """Refuse ``value`` of ``flag`` unless it is in the range (a text option: every number in it).

        Raises:
            OptionError: one line naming the flag, the value and the range.
        """
        numbers = self.parse(flag, value) if self.parse is not None and isinstance(value, str) else [value]
        for number in numbers:
            if not self.contains(number):
                shown = f"{number:g}" if isinstance(number, float) else str(number)
                raise OptionError(f"{flag} {shown} must be {self.text()}")


def _int_list(flag: str, text: str) -> list[Number]:
    try:
        return [int(p) for p in text.split(",") if p.strip()] or [int(text)]
    except ValueError:
        raise OptionError(f"{flag} {text!r} is not a whole number or a comma list of them",
                          f"e.g. {flag} 64,128") from None


def _float_list(flag: str, text: str) -> list[Number]:
    try:
        return [float(p) for p in text.split(",")]
    except ValueError:
        raise OptionError(f"{flag} {text!r} is not a number or a comma list of numbers",
                          f"e.g. {flag} 0.1 (profile: {flag} 0,0.05,0.1)") from None


def _bytes(flag: str, text: str) -> list[Number]:
    from moespec.config import parse_bytes

    return [parse_bytes(text, flag)]


def _size(n: Number) -> str:
    from moespec.config import format_binary

    return format_binary(int(n))


def _layers(flag: str, text: str) -> list[Number]:
    return [] if text.strip() == "auto" else _int_list(flag, text)


CORES = "the cores this process may use"
BIG = 10**9  # counts (tokens, slots) no run reaches; a larger value is a typo, not a wish

# flag -> range, the same on every command that has the flag (defaults: cli/common.py and the commands)
OPTIONS: dict[str, Range] = {
    # 0 passes here: below the model's minimum (K, or 2K when predicting) every value gets the same
    # message, with that minimum in experts and bytes, once the config is read (runtime/offload.num_slots)
    "--cache-experts": Range(int, 0, 1_000_000, why="the model's minimum is said once its config is read"),
    "--gpu-memory": Range(int, 1, 2**44, why="a size such as 2GiB", parse=_bytes, show=_size),
    # below the model's minimum (2K rows) the loader says it in MiB (runtime/disk_tier.ram_slots)
    "--host-memory": Range(int, 1, 2**44, why="a size such as 8GiB", parse=_bytes, show=_size),
    "--group-size": Range(int, 1, 2**20, why="it must also divide I*H, checked when the model loads"),
    "--max-new-tokens": Range(int, 1, 1_000_000),
    "--max-gen-toks": Range(int, 1, 1_000_000),
    "--max-n": Range(int, 1, 128, why="OpenAI's limit for n"),
    "--temperature": Range(float, 0, 1000, why="0 = greedy"),
    "--top-p": Range(float, 0, 1, low_open=True),
    "--seed": Range(int, 0, 2**63 - 1),
    "--threads": Range(int, 1, usable_cores, why=CORES),
    "--host-threads": Range(int, 1, usable_cores, why=CORES),
    "--workers": Range(int, 1, 64, why="processes; each loads the model"),
    "--link-gbps": Range(float, 0, 10_000, low_open=True, why="GB/s"),
    "--copy-share": Range(float, 0, 1, low_open=True, high_open=True, why="a share of on-demand TPOT"),
    "--fetch-threshold": Range(float, 0, 100, why="renormalised gate weight, above 1 never fetches; a comma "
                                                  "list in profile", parse=_float_list),
    "--tokens": Range(int, 1, BIG),
    "--heldout-tokens": Range(int, 1, BIG),
    "--seq-len": Range(int, 1, 1_048_576, why="the model's context is checked when it loads"),
    "--prompt-len": Range(int, 1, 1_048_576, why="a comma list; the model's context is checked when it loads",
                          parse=_int_list),
    "--gen": Range(int, 1, 1_000_000),
    "--repeats": Range(int, 1, 10_000),
    "--warmup": Range(int, 0, 1_000_000),
    "--layers": Range(int, 0, 100_000, why="MoE layer numbers, or auto", parse=_layers),
    "--max-layers": Range(int, 1, 100_000),
    "--auto-below": Range(float, 0, 1, why="a recall"),
    "--down": Range(int, 1, 65_536),
    "--expand": Range(int, 1, 1024),
    "--epochs": Range(int, 1, 100_000),
    "--batch": Range(int, 1, BIG),
    "--lr": Range(float, 0, 10, low_open=True),
    "--margin": Range(float, 0, 1, why="a recall difference"),
    "--port": Range(int, 1, 65_535),
    "--max-queue": Range(int, 0, 1_000_000),
    "--max-body-bytes": Range(int, 1, 2**31),
}

# (command, flag) -> range where the command gives the flag its own meaning
COMMAND_OPTIONS: dict[tuple[str, str], Range] = {
    ("train-estimator", "--link-gbps"): Range(float, 0, 10_000, why="GB/s; 0 ignores the estimator's cost"),
}


def range_of(command: str, flag: str) -> Range | None:
    """The range of ``flag`` on ``command`` (None: not a numeric option)."""
    return COMMAND_OPTIONS.get((command, flag)) or OPTIONS.get(flag)


def check_options(command: str, values: dict[str, object]) -> None:
    """Check every given numeric option of ``command`` (flag -> value; None = not given).

    Raises:
        OptionError: the first value out of its range, in one line.
    """
    for flag, value in values.items():
        spec = range_of(command, flag)
        if spec is not None and value is not None:
            spec.check(flag, value)
