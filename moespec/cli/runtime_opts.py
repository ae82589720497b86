"""Turning shared CLI options into a RuntimeConfig (one place for every command)."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Optional, Sequence, TypeVar

from moespec.config import (DEFAULT_FETCH_THRESHOLD, CachePolicy, ExecuteMode, GuardRule, OnMiss, Predictor,
                            RuntimeConfig, parse_bytes)
from moespec.errors import OptionError

E = TypeVar("E", bound=enum.Enum)


def enum_option(kind: type[E], value: str, flag: str, choices: Optional[Sequence[E]] = None) -> E:
    """Parse ``value`` into the Enum ``kind``, accepting only ``choices``.

    ``choices`` defaults to every member, except for Predictor, where it leaves out ``oracle``: only
    `moespec profile` runs the oracle, and it passes every member.

    Raises:
        OptionError: names the value, the flag and the choices this command accepts.
    """
    if choices is None:
        choices = [m for m in kind if m is not Predictor.ORACLE]
    try:
        member = kind(value)
    except ValueError:
        member = None
    if member is None or member not in choices:
        names = ", ".join(m.value for m in choices)
        why = " here (the oracle replays a recorded trace: `moespec profile` only)" if member is Predictor.ORACLE else ""
        raise OptionError(f"{flag} {value!r} is not valid{why}", f"choose one of: {names}")
    return member


def build_runtime_config(*, device: str, dtype: str, gpu_memory: Optional[str], cache_experts: Optional[int],
                         predictor: Predictor, execute: ExecuteMode, fetch_threshold: float | str | None,
                         link_gbps: Optional[float], calibration: Optional[str] = None,
                         expert_dtype: str = "auto", estimator: Optional[str] = None,
                         group_size: Optional[int] = None, cache_policy: Optional[str] = None,
                         on_miss: str = "fetch", host_threads: Optional[int] = None,
                         guard_rule: str = "budget", requantize: bool = False,
                         host_memory: Optional[str] = None,
                         compile_mode: str = "auto", dense_dtype: str = "auto") -> RuntimeConfig:
    """A RuntimeConfig from CLI values (sizes parsed, enums checked).

    ``cache_policy`` (``--cache-policy``): None picks the default (config.DEFAULT_CACHE_POLICY when a
    calibration file exists, else lru).

    ``estimator`` (``--estimator``) is the estimator file of `estimator` / `hybrid`; it overrides the
    file found automatically. ``on_miss`` is the ``--on-miss`` text (fetch, host, auto).
    ``host_memory`` (``--host-memory``): the RAM tier of the disk tier.
    ``fetch_threshold``: one τ (a number or the ``--fetch-threshold`` text; None = the default).
    ``dense_dtype`` (``--dense-dtype``): how dense linears store their weights (runtime/dense.py).

    Raises:
        OptionError: both --gpu-memory and --cache-experts, or a malformed value.
    """
    if gpu_memory is not None and cache_experts is not None:
        raise OptionError("--gpu-memory and --cache-experts both given", "pass only one of them")
    return RuntimeConfig(
        device=device, dtype=dtype,
        gpu_memory_bytes=parse_bytes(gpu_memory) if gpu_memory is not None else None,
        cache_experts=cache_experts, predictor=predictor, execute=execute,
        fetch_threshold=one_threshold(fetch_threshold), guard_rule=enum_option(GuardRule, guard_rule, "--guard-rule"),
        link_gbps=link_gbps, calibration_path=calibration,
        estimator_path=estimator or None, expert_dtype=expert_dtype, group_size=group_size, requantize=requantize,
        cache_policy=None if cache_policy is None else enum_option(CachePolicy, cache_policy, "--cache-policy"),
        on_miss=enum_option(OnMiss, on_miss, "--on-miss"), host_threads=host_threads,
        host_memory_bytes=parse_bytes(host_memory, "--host-memory") if host_memory is not None else None,
        compile=compile_mode, dense_dtype=dense_dtype,
    )


def threshold_list(text: str | float | None) -> tuple[float, ...]:
    """``--fetch-threshold`` as a tuple of τ values (``0,0.05,0.1``; None = the default; duplicates dropped).

    Raises:
        OptionError: empty, not a number, or negative (names the value and the flag).
    """
    if text is None:
        return (DEFAULT_FETCH_THRESHOLD,)
    # A number (the Python API, config defaults) is one τ as it is; only text is parsed.
    parts = [text] if isinstance(text, (int, float)) else [p.strip() for p in str(text).split(",")]
    values = []
    for part in parts:
        try:
            tau = float(part)
        except ValueError:
            raise OptionError(f"--fetch-threshold {text!r} is not a number or a comma list of numbers",
                              "e.g. --fetch-threshold 0.1 (profile: --fetch-threshold 0,0.05,0.1)") from None
        if not tau >= 0:  # NaN too
            raise OptionError(f"--fetch-threshold {part} must be >= 0", "e.g. --fetch-threshold 0.1")
        values.append(tau)
    return tuple(dict.fromkeys(values))


def one_threshold(text: str | float | None) -> float:
    """``--fetch-threshold`` where one τ is run (chat, serve).

    Raises:
        OptionError: a list (only `moespec profile` compares several), or a bad value.
    """
    values = threshold_list(text)
    if len(values) > 1:
        raise OptionError(f"--fetch-threshold {text!r} is a list; this command runs one value",
                          "pass one value, e.g. --fetch-threshold 0.1 (`moespec profile` compares a list)")
    return values[0]


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


def check_predictor_files(model: Optional[str], cfg: RuntimeConfig, predictors: Sequence[Predictor] = ()) -> Path:
    """Refuse a missing calibration or estimator file now, before anything loads (no torch import).

    Args:
        model: MODEL as given (None = the embedded default model, built or not).
        cfg: the runtime config (its calibration_path / estimator_path are explicit files).
        predictors: the predictors that will run (default: ``cfg.predictor``).

    Returns:
        the model folder the files were looked up for.

    Raises:
        CalibrationError: `quasi` without a calibration file, `estimator`/`hybrid` without an
            estimator file; the message names the path (with ~ for home) and the command that writes it.
        ModelNotFoundError, CheckpointError: MODEL cannot be resolved.
    """
    from moespec.artifacts import find_calibration, find_estimator
    from moespec.hub.resolve import resolve_model
    from moespec.paths import DEFAULT_MODEL_FOLDER, models_dir

    path = models_dir() / DEFAULT_MODEL_FOLDER if model is None else resolve_model(model)
    kinds = set(predictors) or {cfg.predictor}
    if Predictor.QUASI in kinds:
        find_calibration(path, cfg.calibration_path)
    if kinds & {Predictor.ESTIMATOR, Predictor.HYBRID}:
        find_estimator(path, cfg.estimator_path)
    return path
