"""`train-estimator` as a library: choose layers, collect states, train, measure, choose per layer.

Shapes: M MoE layers, S served layers, E experts, H hidden, K top-k.

1. Layers: given, or "auto": the layers whose best parameter-free recall (from the calibration file,
   else measured with the router predictor on held-out text) is below ``auto_below``, worst first.
2. States: text runs through the model in exact mode; the estimator inputs and the true next-layer
   routing go to shards on disk (collect.py), or earlier shards are reused.
3. Training (train.py), then every predictor's cost per decode token is measured on the device and
   the hybrid choice is made per layer (hybrid.py); the result is an EstimatorFile (moespec.predict.estimator_file).
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from moespec.artifacts import find_calibration, model_key
from moespec.errors import CalibrationError, DataError, OptionError
from moespec.estimator.collect import collect_states
from moespec.estimator.states import StatesManifest, read_manifest, read_vectors, vectors_digest
from moespec.estimator.hybrid import HybridConfig, LayerChoice, choose, predictor_costs
from moespec.estimator.train import TrainConfig, TrainProgress, TrainResult, train_bank
from moespec.models.base import Routing
from moespec.predict.base import NextLayerPredictor, RouterPredictor
from moespec.predict.calibration_file import config_hash, load_checked, router_fingerprint
from moespec.predict.estimator import EstimatorPredictor
from moespec.predict.estimator_file import EstimatorFile
from moespec.predict.estimator_net import EstimatorBank, EstimatorShape
from moespec.predict.quasi import QuasiPredictor
from moespec.runtime.chunks import measure_recall


@dataclass(frozen=True)
class EstimatorConfig:
    """What `moespec train-estimator` does, with defaults in one place.

    Attributes:
        tokens: training tokens (``--tokens``); heldout_tokens: validation tokens (None = tokens / 10).
        seq_len: tokens per prefill chunk.
        layers: served layers, or None for "auto".
        auto_below: "auto" serves layers whose best parameter-free recall is below this.
        max_layers: "auto" serves at most this many layers (the worst).
        input: "auto" (quasi with a calibration file, else router), "quasi" or "router".
        down, expand, shared: the estimator shape (m, n, one shared network).
        train: training settings; hybrid: choice settings.
        seed: init, shuffling and data order.
    """

    tokens: int = 500_000
    heldout_tokens: int | None = None
    seq_len: int = 512
    layers: tuple[int, ...] | None = None
    auto_below: float = 0.9
    max_layers: int = 8
    input: str = "auto"
    down: int = 8
    expand: int = 2
    shared: bool = False
    train: TrainConfig = field(default_factory=TrainConfig)
    hybrid: HybridConfig = field(default_factory=HybridConfig)
    seed: int = 0


@dataclass
class Outcome:
    """A finished training: the file to write and what happened on the way."""

    file: EstimatorFile
    result: TrainResult
    choices: dict[int, LayerChoice]
    manifest: StatesManifest


def find_model_calibration(om, explicit: str | None):
    """The model's calibration (checked against it), or None when it has none.

    Raises:
        CalibrationError: an explicit file is missing, or the file is corrupt or another model's.
    """
    try:
        path = find_calibration(om.path, explicit)
    except CalibrationError:
        if explicit is not None:
            raise
        return None
    refs = om.layer_refs()
    return load_checked(path, om.config, [r.layer for r in refs], [r.block.gate.weight for r in refs], om.path)


def free_predictors(om, calib) -> dict[str, NextLayerPredictor]:
    """"router", and "quasi" when the model is calibrated."""
    refs = om.layer_refs()
    out: dict[str, NextLayerPredictor] = {"router": RouterPredictor(om.adapter, refs)}
    if calib is not None:
        out["quasi"] = QuasiPredictor(om.adapter, refs, {layer: calib.vectors[m].to(om.device)
                                                         for m, layer in enumerate(calib.layers)})
    return out


def input_kind(requested: str, calib) -> str:
    """The estimator input: "quasi" or "router".

    Raises:
        OptionError: "quasi" asked for but the model has no calibration file.
    """
    if requested == "auto":
        return "quasi" if calib is not None else "router"
    if requested == "quasi" and calib is None:
        raise OptionError("--input quasi needs a calibration file for this model",
                          "run `moespec calibrate MODEL` first, or use --input router")
    if requested not in ("quasi", "router"):
        raise OptionError(f"--input {requested!r} is not valid", "choose one of: auto, quasi, router")
    return requested


def predictable_layers(om) -> list[int]:
    """MoE layers that have a next MoE layer (the ones an estimator can serve)."""
    return list(om.store.moe_layers[:-1])


def check_layers(om, layers: tuple[int, ...]) -> list[int]:
    """The requested served layers, sorted.

    Raises:
        OptionError: a layer that is not an MoE layer with a next MoE layer.
    """
    valid = predictable_layers(om)
    bad = [x for x in layers if x not in valid]
    if bad or not layers:
        raise OptionError(f"--layers {','.join(map(str, layers)) or '(none)'}: {bad or 'no layers'} cannot be served",
                          f"choose among the MoE layers that have a next MoE layer: {','.join(map(str, valid))}, or auto")
    return sorted(set(layers))


def auto_layers(om, calib, heldout: list[list[int]], cfg: EstimatorConfig,
                progress: Callable[[str, int, int], None] | None = None) -> tuple[list[int], dict[int, float], str]:
    """(served layers, best parameter-free recall per source layer, where the recall came from).

    With a calibration, its held-out recall of `router` and `quasi`; without, recall of `router`
    measured on (at most 8192 tokens of) ``heldout``.
    """
    valid = predictable_layers(om)
    nxt = dict(zip(om.store.moe_layers, om.store.moe_layers[1:]))
    if calib is not None:
        pos = {layer: m for m, layer in enumerate(calib.layers)}
        best = {}
        for layer in valid:
            vals = [float(calib.metric("recall", p)[pos[nxt[layer]]]) for p in ("router", "quasi")]
            vals = [v for v in vals if not math.isnan(v)]
            best[layer] = max(vals) if vals else 0.0
        source = "calibration file"
    else:
        chunks, n = [], 0
        for c in heldout:
            if n >= 8192:
                break
            chunks.append(c)
            n += len(c)
        metrics = measure_recall(om, chunks, {"router": RouterPredictor(om.adapter, om.layer_refs())}, progress)
        pos = {layer: m for m, layer in enumerate(om.store.moe_layers)}
        best = {layer: float(metrics["recall/router"][pos[nxt[layer]]]) for layer in valid}
        source = f"router recall on {n} held-out tokens"
    worst = sorted(valid, key=lambda layer: best[layer])
    chosen = [layer for layer in worst if best[layer] < cfg.auto_below][: cfg.max_layers]
    if not chosen:
        chosen = worst[:1]
    return sorted(chosen), best, source


def prepare_states(om, plan, layers: list[int], kind: str, calib, folder: Path, reuse: bool, data: str,
                   seq_len: int, progress=None) -> tuple[StatesManifest, bool]:
    """(manifest, reused): the states of ``layers`` in ``folder``, collected now or reused.

    Raises:
        DataError: ``reuse`` and the folder holds states of another model, layers or input.
    """
    refs = om.layer_refs()
    predictors = free_predictors(om, calib)
    vectors = None
    if kind == "quasi":
        pos = {layer: m for m, layer in enumerate(calib.layers)}
        vectors = torch.stack([calib.vectors[pos[layer]] for layer in layers])  # [S, E, H]
    nxt = dict(zip(om.store.moe_layers, om.store.moe_layers[1:]))
    want = StatesManifest(
        model=model_key(om.path), config_hash=config_hash(om.config),
        router_fingerprint=router_fingerprint([r.block.gate.weight for r in refs]),
        moe_layers=list(om.store.moe_layers), layers=list(layers), targets=[nxt[layer] for layer in layers],
        input=kind, hidden=om.store.layout.hidden, experts=om.store.num_experts, top_k=om.adapter.top_k(),
        seq_len=seq_len, data=data)
    if reuse:
        have = read_manifest(folder)
        if have is not None:
            if have.identity() != want.identity():
                raise DataError(f"states in {folder} were collected for layers {have.layers} with input {have.input} "
                                f"(config hash {have.config_hash}), not layers {want.layers} with input {want.input} "
                                f"(config hash {want.config_hash})",
                                "drop --reuse-states to collect them again, or pass the same --layers / --input")
            if kind == "quasi" and vectors_digest(read_vectors(folder)) != vectors_digest(vectors):
                raise DataError(f"states in {folder} were made with other default vectors (the model was calibrated "
                                "again since)", "drop --reuse-states to collect them again")
            return have, True
    return collect_states(om, plan, want, predictors, folder, vectors, progress), False


def fit(om, folder: Path, manifest: StatesManifest, cfg: EstimatorConfig, calib,
        progress: TrainProgress | None = None) -> Outcome:
    """Train estimators on the states in ``folder``, measure costs, choose per layer; nothing written."""
    import moespec

    layers = manifest.layers
    refs = {r.layer: r for r in om.layer_refs()}
    torch.manual_seed(cfg.seed)
    shape = EstimatorShape(hidden=manifest.hidden, experts=manifest.experts, down=cfg.down, expand=cfg.expand,
                           shared=cfg.shared)
    bank = EstimatorBank(shape, layers).to(om.device)
    target = dict(zip(manifest.layers, manifest.targets))

    def select(layer: int, logits: torch.Tensor) -> torch.Tensor:
        return om.adapter.select(refs[target[layer]].block, logits).ids

    result = train_bank(bank, folder, manifest, cfg.train, select, progress)
    bank = bank.cpu().eval()
    vectors = read_vectors(folder) if manifest.input == "quasi" else None

    costs = measure_costs(om, bank, vectors, layers, calib)
    m_index = {layer: m for m, layer in enumerate(manifest.moe_layers)}
    nan = [math.nan] * len(manifest.moe_layers)
    metrics = {k: torch.tensor(v, dtype=torch.float32) for k, v in manifest.baseline.items()}
    for metric, per_layer in (("recall", result.recall), ("weighted_recall", result.weighted_recall)):
        vals = list(nan)
        for layer, v in per_layer.items():
            vals[m_index[layer]] = v
        metrics[f"{metric}/estimator"] = torch.tensor(vals, dtype=torch.float32)
    for name in ("router", "quasi", "estimator"):
        vals = list(nan)
        for layer in layers:
            if name in costs[layer]:
                vals[m_index[layer]] = costs[layer][name]
        metrics[f"cost_ms/{name}"] = torch.tensor(vals, dtype=torch.float32)

    choices = {}
    for layer in predictable_layers(om):
        recall = {name: float(metrics[f"recall/{name}"][m_index[layer]])
                  for name in ("router", "quasi", "estimator") if f"recall/{name}" in metrics}
        choices[layer] = choose(recall, costs.get(layer, {}), manifest.top_k, om.store.expert_bytes, cfg.hybrid)
    meta = {
        "model": manifest.model, "config_hash": manifest.config_hash, "router_fingerprint": manifest.router_fingerprint,
        "moespec_version": moespec.__version__, "tokens": manifest.tokens, "heldout_tokens": manifest.heldout_tokens,
        "train_rows_seen": result.train_rows, "steps": result.steps, "stopped_early": result.stopped_early,
        "best_step": {str(k): v for k, v in result.best_step.items()}, "seq_len": manifest.seq_len,
        "data": manifest.data, "seed": cfg.seed, "train": asdict(cfg.train), "margin": cfg.hybrid.margin,
        "link_gbps": cfg.hybrid.link_gbps, "expert_bytes": om.store.expert_bytes, "top_k": manifest.top_k,
        "cost_device": str(om.device), "parameters": bank.num_parameters(),
    }
    ef = EstimatorFile(bank=bank, moe_layers=list(manifest.moe_layers), input=manifest.input, vectors=vectors,
                       choice={layer: c.predictor for layer, c in choices.items()}, metrics=metrics, meta=meta)
    return Outcome(ef, result, choices, manifest)


def measure_costs(om, bank: EstimatorBank, vectors: torch.Tensor | None, layers: list[int], calib,
                  repeats: int = 50) -> dict[int, dict[str, float]]:
    """Served layer -> predictor name -> ms per decode token, measured on the model's device and dtype."""
    refs = om.layer_refs()
    run_bank = copy.deepcopy(bank).to(device=om.device, dtype=om.dtype)
    inputs = None if vectors is None else {layer: vectors[i].to(om.device) for i, layer in enumerate(layers)}
    predictors = dict(free_predictors(om, calib))
    predictors["estimator"] = EstimatorPredictor(om.adapter, refs, run_bank, {layer: "estimator" for layer in layers},
                                                 inputs, None)
    k = om.adapter.top_k()
    used = Routing(ids=torch.arange(k, device=om.device).unsqueeze(0),  # [1, K]
                   weights=torch.full((1, k), 1.0 / k, device=om.device, dtype=om.dtype))
    return {layer: predictor_costs(predictors, layer, om.store.layout.hidden, om.device, om.dtype, used, repeats)
            for layer in layers}
