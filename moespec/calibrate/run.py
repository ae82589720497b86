"""Calibration through the offloading runtime: two passes of prefill chunks, exact mode.

Pass 1 runs the calibration chunks with a DefaultVectorCollector as the MoE runner's observer
(default vectors of both variants, expert frequencies). Pass 2 runs the held-out chunks with a
RecallObserver scoring `router` and `quasi` (each variant) against the true routing; the variant
with the better mean recall@K becomes the file's default vectors. Every chunk is an independent
prefill (fresh KV cache), so a model that does not fit the device is calibrated by streaming its
experts layer by layer through the cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from moespec.artifacts import model_key
from moespec.calibrate.collect import VARIANTS, DefaultVectorCollector, DefaultVectors
from moespec.calibrate.data import ChunkPlan
from moespec.calibrate.policy_report import held_out_trace, policy_hit_rates
from moespec.config import CachePolicy
from moespec.predict.base import NextLayerPredictor, RouterPredictor
from moespec.predict.calibration_file import Calibration, config_hash, finite_mean, router_fingerprint
from moespec.predict.quasi import QuasiPredictor
from moespec.predict.recall import METRICS
from moespec.runtime.chunks import Progress, measure_recall, run_chunks
from moespec.runtime.model import OffloadedModel


@dataclass(frozen=True)
class CalibrateConfig:
    """What `moespec calibrate` does, with defaults in one place.

    Attributes:
        tokens: calibration tokens for default vectors and frequencies (``--tokens``).
        heldout_tokens: tokens to measure recall on; None = a tenth of ``tokens``, at least one chunk.
        seq_len: tokens per chunk, each run as one prefill pass (``--seq-len``).
        seed: shuffles the documents of a folder or .jsonl (``--seed``).
        policies: cache policies whose held-out hit rates the report shows (``--cache-policy``).
    """

    tokens: int = 100_000
    heldout_tokens: int | None = None
    seq_len: int = 512
    seed: int = 0
    policies: tuple[CachePolicy, ...] = tuple(CachePolicy)


@dataclass(frozen=True)
class CalibrationRun:
    """A finished calibration and how long its passes took (kept out of the file: it is not data)."""

    calibration: Calibration
    calib_s: float
    heldout_s: float
    policy_hit_rates: dict[str, list[float]] = field(default_factory=dict)  # policy -> at 12.5/25/50 %


def collect_default_vectors(om: OffloadedModel, chunks: list[list[int]], progress: Progress | None = None) -> DefaultVectors:
    """Pass 1: default vectors (both variants) and frequencies over ``chunks``."""
    collector = DefaultVectorCollector(om.store.moe_layers, om.store.num_experts, om.store.layout.hidden, om.device)
    run_chunks(om, chunks, collector, "calibrate", progress)
    return collector.result()


def calibration_predictors(om: OffloadedModel, dv: DefaultVectors) -> dict[str, NextLayerPredictor]:
    """`router` and one `quasi_<variant>` per default-vector variant, over the loaded model."""
    refs = om.layer_refs()
    out: dict[str, NextLayerPredictor] = {"router": RouterPredictor(om.adapter, refs)}
    for variant, vectors in dv.vectors.items():
        per_layer = {layer: vectors[m].to(om.device) for m, layer in enumerate(dv.layers)}  # [E, H]
        out[f"quasi_{variant}"] = QuasiPredictor(om.adapter, refs, per_layer)
    return out


def choose_variant(metrics: dict[str, torch.Tensor]) -> str:
    """The variant whose quasi predictor has the best mean recall@K (ties: the paper's "mean")."""
    best, best_recall = VARIANTS[0], float("-inf")
    for variant in VARIANTS:
        r = finite_mean(metrics[f"recall/quasi_{variant}"])
        if r == r and r > best_recall:  # r == r: not NaN
            best, best_recall = variant, r
    return best


def calibrate(om: OffloadedModel, plan: ChunkPlan, cfg: CalibrateConfig, data: str, heldout_data: str,
              progress: Progress | None = None) -> CalibrationRun:
    """Run both passes on the loaded model ``om`` and return the calibration (not yet written).

    Args:
        om: the model, loaded for exact execution.
        plan: calibration and held-out chunks.
        cfg: the settings (recorded in the metadata).
        data, heldout_data: descriptions of the text sources.
        progress: called after every chunk.
    """
    import moespec

    t0 = time.perf_counter()
    dv = collect_default_vectors(om, plan.calib, progress)
    t1 = time.perf_counter()
    ids: dict = {}
    metrics = measure_recall(om, plan.heldout, calibration_predictors(om, dv), progress, ids)
    t2 = time.perf_counter()
    hit_rates = policy_hit_rates(held_out_trace(ids), dv.layers, dv.frequencies, om.adapter.top_k(),
                                 list(cfg.policies))
    variant = choose_variant(metrics)
    for metric in METRICS:
        metrics[f"{metric}/quasi"] = metrics[f"{metric}/quasi_{variant}"].clone()
    refs = om.layer_refs()
    meta = {
        "model": model_key(om.path),
        "config_hash": config_hash(om.config),
        "router_fingerprint": router_fingerprint([r.block.gate.weight for r in refs]),
        "moespec_version": moespec.__version__,
        "tokens": dv.tokens,
        "heldout_tokens": plan.heldout_tokens,
        "seq_len": cfg.seq_len,
        "seed": cfg.seed,
        "data": data,
        "heldout_data": heldout_data,
        "dtype": str(om.dtype).removeprefix("torch."),
        "top_k": om.adapter.top_k(),
    }
    calib = Calibration(layers=dv.layers, default_vectors=dv.vectors, variant=variant, frequencies=dv.frequencies,
                        unrouted=dv.unrouted, metrics=metrics, meta=meta)
    return CalibrationRun(calib, calib_s=t1 - t0, heldout_s=t2 - t1, policy_hit_rates=hit_rates)
