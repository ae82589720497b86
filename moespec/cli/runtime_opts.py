"""Turning shared CLI options into a RuntimeConfig (one place for every command)."""

from __future__ import annotations

import enum
from typing import Optional, TypeVar

from moespec.config import ExecuteMode, OnMiss, Predictor, RuntimeConfig, parse_bytes
from moespec.errors import OptionError

E = TypeVar("E", bound=enum.Enum)


def enum_option(kind: type[E], value: str, flag: str) -> E:
    """Parse ``value`` into the Enum ``kind``.

    Raises:
        OptionError: names the value, the flag and the valid choices.
    """
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(m.value for m in kind)
        raise OptionError(f"{flag} {value!r} is not valid", f"choose one of: {choices}") from None


def build_runtime_config(*, device: str, dtype: str, gpu_memory: Optional[str], cache_experts: Optional[int],
                         predictor: Predictor, execute: ExecuteMode, fetch_threshold: float,
                         link_gbps: Optional[float], calibration: Optional[str] = None,
                         expert_dtype: str = "auto", estimator: Optional[str] = None, on_miss: str = "fetch",
                         host_threads: Optional[int] = None) -> RuntimeConfig:
    """A RuntimeConfig from CLI values (sizes parsed, enums checked).

    ``estimator`` (``--estimator``) is the estimator file of `estimator` / `hybrid`; it overrides the
    file found automatically. ``on_miss`` is the ``--on-miss`` text (fetch, host, auto).

    Raises:
        OptionError: both --gpu-memory and --cache-experts, or a malformed value.
    """
    if gpu_memory is not None and cache_experts is not None:
        raise OptionError("--gpu-memory and --cache-experts both given", "pass only one of them")
    return RuntimeConfig(
        device=device, dtype=dtype,
        gpu_memory_bytes=parse_bytes(gpu_memory) if gpu_memory is not None else None,
        cache_experts=cache_experts, predictor=predictor, execute=execute,
        fetch_threshold=fetch_threshold, link_gbps=link_gbps, calibration_path=calibration,
        estimator_path=estimator or None, expert_dtype=expert_dtype,
        on_miss=enum_option(OnMiss, on_miss, "--on-miss"), host_threads=host_threads,
    )


def check_estimator_use(estimator: Optional[str], predictors: list[Predictor]) -> None:
    """Refuse ``--estimator`` when no predictor that reads it (estimator, hybrid) is asked for.

    Raises:
        OptionError: names the flag and the predictors that use it.
    """
    if estimator and not any(p in (Predictor.ESTIMATOR, Predictor.HYBRID) for p in predictors):
        asked = ", ".join(p.value for p in predictors) or "none"
        raise OptionError(f"--estimator {estimator} is read only by the estimator and hybrid predictors, not {asked}",
                          "add --predictor hybrid (chat) or estimator/hybrid to --strategies (profile), "
                          "or drop --estimator")
