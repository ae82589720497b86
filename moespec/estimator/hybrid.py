"""The hybrid choice: per layer, router, quasi or estimator, by held-out recall, margin and cost.

Shapes: H hidden, E experts, K top-k.

A prediction pays off through copies it saves: a layer whose predictor recalls Δ more of the true
top-K saves about Δ·K expert copies per token, each ``expert_bytes / link`` long. The estimator
is chosen at a layer only when its recall beats the best parameter-free predictor (router, quasi)
by more than ``margin`` and the copy time it saves exceeds its measured extra cost per token (the
estimator runs inside the decode step, before the next layer's copies are issued).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

FREE = ("router", "quasi")  # parameter-free predictors, in tie-break order (cheapest first)


@dataclass(frozen=True)
class HybridConfig:
    """How the per-layer choice is made.

    Attributes:
        margin: recall@K the estimator must gain over the best parameter-free predictor.
        link_gbps: host-to-device bandwidth the saved copies are valued at (GB/s); None = ignore cost.
    """

    margin: float = 0.02
    link_gbps: float | None = 25.0


@dataclass(frozen=True)
class LayerChoice:
    """The choice at one served layer and why.

    Attributes:
        predictor: "router", "quasi" or "estimator".
        gain: estimator recall minus the best parameter-free recall (NaN without an estimator).
        saved_ms: copy time per token the gain is worth (gain · K · one expert's copy time).
        extra_ms: the estimator's cost per token beyond the best parameter-free predictor's.
    """

    predictor: str
    gain: float = math.nan
    saved_ms: float = math.nan
    extra_ms: float = math.nan


def best_free(recall: dict[str, float]) -> str:
    """The parameter-free predictor with the best recall (NaN / absent entries lose; ties: router)."""
    best, best_r = FREE[0], -1.0
    for name in FREE:
        r = recall.get(name, math.nan)
        if not math.isnan(r) and r > best_r:
            best, best_r = name, r
    return best


def choose(recall: dict[str, float], cost_ms: dict[str, float], top_k: int, expert_bytes: int,
           cfg: HybridConfig) -> LayerChoice:
    """The predictor for one layer.

    Args:
        recall: predictor name -> held-out recall@K at this layer ("estimator" absent = not served).
        cost_ms: predictor name -> measured cost per decode token (ms).
        top_k: K.
        expert_bytes: bytes of one packed expert (one copy).
        cfg: margin and link.
    """
    free = best_free(recall)
    est = recall.get("estimator", math.nan)
    if math.isnan(est):
        return LayerChoice(free)
    gain = est - recall.get(free, math.nan)
    if math.isnan(gain):
        gain = est  # no parameter-free measurement: anything beats nothing
    if cfg.link_gbps is None:
        saved, extra = math.nan, math.nan
        pays = True
    else:
        copy_ms = expert_bytes / (cfg.link_gbps * 1e9) * 1e3
        saved = gain * top_k * copy_ms
        extra = cost_ms.get("estimator", 0.0) - cost_ms.get(free, 0.0)
        pays = saved > extra
    return LayerChoice("estimator" if gain > cfg.margin and pays else free, gain, saved, extra)


def time_per_call_ms(fn: Callable[[], object], device: torch.device, repeats: int = 50, warmup: int = 5) -> float:
    """Median wall time of ``fn()`` in ms; the device is synchronised before each clock read."""
    # Named device: a bare torch.cuda.synchronize() would wait on (and create a context on) cuda:0.
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()  # why: CUDA kernels are asynchronous; without it the clock measures the launch only
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@torch.inference_mode()
def predictor_costs(predictors: dict, layer: int, hidden: int, device: torch.device, dtype: torch.dtype,
                    used, repeats: int = 50) -> dict[str, float]:
    """name -> measured ms per decode token of ``predictor.predict(layer, r [1, H], used)``.

    ``used`` is a one-token routing of ``layer`` (quasi reads it to form d_l).
    """
    r = torch.randn(1, hidden, device=device, dtype=dtype)  # [1, H]
    return {name: time_per_call_ms(lambda p=p: p.predict(layer, r, used), device, repeats)
            for name, p in predictors.items()}
