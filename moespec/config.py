"""Runtime configuration: frozen dataclasses and Enums, defaults in one place."""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass

from moespec.errors import OptionError


class Predictor(str, enum.Enum):
    """How the next layer's experts are predicted (``--predictor``; moespec/predict)."""

    NONE = "none"  # no prefetch: on-demand loading (the paper's baseline)
    ROUTER = "router"  # router_{l+1}(LN_{l+1}(r_l)) (Eliseev & Mazur 2023)
    QUASI = "quasi"  # router_{l+1}(LN_{l+1}(r_l + d_l)) (arXiv 2603.19289, quasi-hidden state)
    ESTIMATOR = "estimator"  # distilled estimator q_l -> z_{l+1}
    HYBRID = "hybrid"  # per layer, the best calibrated of the above
    ORACLE = "oracle"  # true routing replayed from a recorded trace (profile only)


class ExecuteMode(str, enum.Enum):
    """What runs at layer l+1 when the prediction was wrong (README, "What `exact` means", "Guarded mode")."""

    EXACT = "exact"  # true router; missing experts fetched synchronously
    SPECULATIVE = "speculative"  # predicted experts with predicted weights (the paper)
    GUARDED = "guarded"  # true router; light misses skipped by --guard-rule/--fetch-threshold


class GuardRule(str, enum.Enum):
    """Which misses `guarded` mode skips (runtime/layer/guard.py, ``--guard-rule``); τ = ``--fetch-threshold``."""

    THRESHOLD = "threshold"  # every miss whose renormalised weight is < τ
    BUDGET = "budget"  # misses lightest first while the token's skipped weight stays <= τ


class CachePolicy(str, enum.Enum):
    """Which expert the cache area evicts (runtime/cache/eviction.py, ``--cache-policy``)."""

    LRU = "lru"  # least recently used
    LFU = "lfu"  # least frequently used, seeded from calibration frequencies
    LFRU = "lfru"  # frequency decayed by recency, seeded from calibration frequencies
    STATIC = "static"  # a per-layer hot set from calibration frequencies is never evicted; LRU else

    @property
    def needs_calibration(self) -> bool:
        """True when the rule is seeded from the calibration file's expert frequencies."""
        return self != CachePolicy.LRU


# Guarded mode's default rule and τ, chosen on the default model's bytes-vs-quality curve (README,
# "Guarded mode"): budget 0.2 moved 25 % fewer bytes than exact at perplexity +2.0 %, top-1 95.3 %.
DEFAULT_FETCH_THRESHOLD = 0.2

# Measured on the default model (README, "Cache policies"): used when a calibration file is found.
DEFAULT_CACHE_POLICY = CachePolicy.LFRU
class OnMiss(str, enum.Enum):
    """Where an expert that is not in the device cache runs (README, "Where a miss runs")."""

    FETCH = "fetch"  # copy it into a slot and compute on the device (on-demand loading)
    HOST = "host"  # compute it on the host from its store row; only its [t, H] output moves
    AUTO = "auto"  # per miss, whichever the measured costs say finishes first


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str, flag: str = "--gpu-memory") -> int:
    """Parse a byte size such as ``2GiB``, ``512MB`` or ``1000000`` into bytes.

    Raises:
        OptionError: the text is not a size (names the value and ``flag``).
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise OptionError(f"{flag} {text!r} is not a size", "write it like 2GiB, 512MiB or 3GB")
    return int(float(m.group(1)) * _UNITS[unit])


def format_binary(n: int, round_up: bool = False) -> str:
    """``n`` bytes in binary units as a user writes them for --gpu-memory: ``4.22MiB``, ``8GiB``.

    Two decimals; ``round_up`` rounds the last one up, so ``parse_bytes`` of the text is >= ``n``
    (for hints naming a budget that is enough).
    """
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            value = n / size
            if round_up:
                value = math.ceil(value * 100 - 1e-9) / 100
            return f"{value:.2f}".rstrip("0").rstrip(".") + unit
    return f"{n}B"


@dataclass(frozen=True)
class RuntimeConfig:
    """Everything the offloading runtime needs to know, passed explicitly.

    Attributes:
        device: "cpu", "cuda" or "cuda:N"; dense parts and the expert cache live there.
        dtype: "auto" (the checkpoint's), "float32", "bfloat16" or "float16".
        gpu_memory_bytes: device bytes for expert slots (``--gpu-memory``); None = use cache_experts.
        cache_experts: number of expert slots (``--cache-experts``); None with gpu_memory_bytes None
            means every expert fits (no offloading pressure).
        predictor: how the next layer's experts are predicted.
        execute: what runs on a wrong prediction.
        fetch_threshold: τ of the guarded mode, in renormalised gate weight (0 = exact, >1 never fetch).
        guard_rule: how τ picks the misses guarded mode skips (runtime/layer/guard.py).
        guard_substitute: run the best resident expert by router logit in place of a skipped one
            (False: drop it and renormalise over what runs).
        link_gbps: emulated host->device link in GB/s on CPU (None = unthrottled copies).
        calibration_path: calibration file for the quasi predictor (None = look next to the model).
        estimator_path: estimator file for the estimator/hybrid predictors (None = found automatically).
        cache_policy: eviction rule of the expert cache; None = DEFAULT_CACHE_POLICY when the model
            has a calibration file, else LRU (a seeded policy needs its frequencies).
        expert_dtype: "auto" keeps the checkpoint's expert format (GPT-OSS MXFP4 stays packed in host
            memory and is dequantised on the device after each copy); a dtype name (e.g. "bf16")
            dequantises packed experts once at load into that dtype, which must be the compute dtype;
            "int8" / "int4" quantises the experts group-wise while the checkpoint streams in (rows moved
            packed, dequantised after each copy; GPT-OSS refuses them).
        group_size: weights per scale/zero point of int8/int4 experts (``--group-size``); None = default.
        requantize: with int8/int4, quantise experts that a GGUF already stores quantised (``--requantize``:
            dequantised, then quantised again); without it that is refused.
        on_miss: where a cache miss runs (``--on-miss``): fetched, on the host, or chosen per miss.
        host_threads: worker threads of the host expert pool (``--host-threads``); None = measured at load.
        prediction_gate: exact and guarded layers predict only while prefetching measurably pays
            (runtime/layer/gate.py; ``--on-miss auto`` has its own); False: every layer predicts.
        host_memory_bytes: RAM for expert rows read from disk (``--host-memory``; the disk tier,
            runtime/disk_tier.py); None = every expert in RAM when it fits, else the disk tier with
            what fits beside the dense part.
        disk_reads: how the disk tier reads rows: "direct" (O_DIRECT reader pool) or "mmap" (the
            baseline: the store file mapped, rows faulted in through the page cache, no reader pool).
        compile: the compiled dense path of decode steps (``--compile``, runtime/compile.py): "on",
            "off", or "auto" (on for CUDA; off on CPU, where it measured no faster: README).
        dense_dtype: how the dense linears and lm_head store their weights (``--dense-dtype``,
            runtime/dense.py): "auto" (the compute dtype), "float32", "bf16" (float32 compute only)
            or "int8" (group-wise, weight-only); bf16 / int8 on the CPU kernels only.
    """

    device: str = "cpu"
    dtype: str = "auto"
    gpu_memory_bytes: int | None = None
    cache_experts: int | None = None
    predictor: Predictor = Predictor.ROUTER
    execute: ExecuteMode = ExecuteMode.EXACT
    fetch_threshold: float = DEFAULT_FETCH_THRESHOLD
    guard_rule: GuardRule = GuardRule.BUDGET
    guard_substitute: bool = True
    link_gbps: float | None = None
    calibration_path: str | None = None
    estimator_path: str | None = None
    expert_dtype: str = "auto"
    group_size: int | None = None
    requantize: bool = False
    cache_policy: CachePolicy | None = None
    on_miss: OnMiss = OnMiss.FETCH
    host_threads: int | None = None
    prediction_gate: bool = True
    host_memory_bytes: int | None = None
    disk_reads: str = "direct"
    compile: str = "auto"
    dense_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.host_threads is not None and self.host_threads < 1:
            raise OptionError(f"--host-threads {self.host_threads} must be at least 1",
                              "pass --host-threads 1 or more, or leave it out (measured at load)")
        # --cache-experts below the minimum (0 included) is refused when the model is known, with the
        # real minimum in experts and bytes (moespec.runtime.load.num_slots): one message for every value.
        if self.compile not in ("auto", "on", "off"):
            raise OptionError(f"--compile {self.compile!r} is not valid", "choose one of: auto, on, off")
        if self.dense_dtype not in ("auto", "float32", "bf16", "bfloat16", "int8"):  # runtime.dense.DENSE_DTYPES
            raise OptionError(f"--dense-dtype {self.dense_dtype!r} is not valid",
                              "choose one of: auto, float32, bf16, int8")
        if self.disk_reads not in ("direct", "mmap"):  # any other text would silently read direct
            raise OptionError(f"disk_reads {self.disk_reads!r} is not valid", "choose one of: direct, mmap")
        if self.link_gbps is not None and self.link_gbps <= 0:
            raise OptionError(f"--link-gbps {self.link_gbps} must be positive")
        if self.fetch_threshold < 0:
            raise OptionError(f"--fetch-threshold {self.fetch_threshold} must be >= 0")
        if self.predictor == Predictor.ORACLE:
            raise OptionError("--predictor oracle replays a recorded trace", "use it in `moespec profile`")


@dataclass(frozen=True)
class SamplingConfig:
    """Token sampling: greedy when temperature == 0, else temperature + nucleus (top-p).

    Attributes:
        max_new_tokens: most generated tokens per answer (the prompt is not counted; a stop token is).
        temperature: 0 = greedy; any finite positive value samples (a tiny one acts as greedy).
        top_p: nucleus mass in (0, 1]; 1 keeps every token.
        seed: seed of the sampling generator; the same seed gives the same tokens.

    Raises:
        OptionError: a value out of range (names the flag).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise OptionError(f"--max-new-tokens {self.max_new_tokens} must be at least 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise OptionError(f"--temperature {self.temperature} must be a finite number >= 0", "0 = greedy")
        if not 0 < self.top_p <= 1:
            raise OptionError(f"--top-p {self.top_p} must be in (0, 1]")
