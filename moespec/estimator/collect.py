"""Training data for the estimators: states and true next-layer routing, streamed to disk in shards.

Shapes: T tokens, H hidden, E experts, K top-k, S served layers, M MoE layers.

A served MoE layer l predicts the next MoE layer l'. Running text through the model in exact mode,
``StateCollector`` (an observer of the MoE runner) records per token:
  state/<l>    [T, H] bf16  the estimator input q = LN_{l'}(r_l + d_l) (input "quasi") or LN_{l'}(r_l) ("router")
  logits/<l>   [T, E] f32   the true router logits of l' (the distillation target)
  ids/<l>      [T, K] i64   the true routing of l' (for recall@K)
  weights/<l>  [T, K] f32   its gate weights (for weighted recall)
Rows are written to ``<split>-NNNNN.safetensors`` shards of about ``SHARD_BYTES`` each, so token counts
beyond RAM work; ``manifest.json`` is written last, so an interrupted collection is never reused.
The held-out split also scores the parameter-free predictors (router, quasi) on the same tokens,
stored in the manifest for the hybrid choice.

Fast path: a training forward ends at the router of the last target layer (``truncate``, the default):
the layers after it, the final norm and the LM head cannot change any recorded row, so they are not
run. The slow reference runs every layer (``truncate=False``); tests compare the two. The held-out
split always runs every layer, because it scores the parameter-free predictors at every layer.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

import torch

from moespec.errors import DataError
from moespec.estimator.states import (SHARD_BYTES, ShardWriter, StatesManifest, clear_states, save_vectors,
                                      write_manifest)
from moespec.predict.base import NextLayerPredictor
from moespec.predict.recall import RecallObserver
from moespec.runtime.chunks import Progress, StopForward, run_chunks

class StateCollector:
    """Observer for ``MoeLayerRunner.observer``: writes (state of l, true routing of l') rows.

    Args:
        predictor: a RouterPredictor (input "router") or QuasiPredictor (input "quasi") over the model's
            layers; its ``signal`` and the next layer's norm make the state.
        layers: the served layers.
        writer: where rows go.
        stop_early: raise StopForward once the last target layer's routing is recorded, so the rest
            of the model does not run (the rows are the same either way).
    """

    def __init__(self, predictor: NextLayerPredictor, layers: list[int], writer: ShardWriter,
                 stop_early: bool = False) -> None:
        self.predictor = predictor
        self.layers = list(layers)
        self.writer = writer
        self.source_of = {predictor.target(layer).layer: layer for layer in self.layers}  # l' -> l
        self.last_target = max(self.source_of) if stop_early else None
        self._rows: dict[str, torch.Tensor] = {}

    def routing(self, layer: int, x: torch.Tensor, residual: torch.Tensor | None, routing) -> None:
        src = self.source_of.get(layer)
        if src is not None:
            logits = routing.logits
            if logits is None:
                logits = self.predictor.adapter.router_logits(self.predictor.refs[layer].block, x)
            self._rows[f"logits/{src}"] = logits.float()  # [T, E]
            self._rows[f"ids/{src}"] = routing.ids.to(torch.int64)  # [T, K]
            self._rows[f"weights/{src}"] = routing.weights.float()  # [T, K]
        if layer in self.layers and residual is not None:
            nxt = self.predictor.target(layer)
            r = residual.reshape(-1, residual.shape[-1])  # [T, H]
            self._rows[f"state/{layer}"] = nxt.norm(self.predictor.signal(layer, r, routing)).to(torch.bfloat16)
        if layer == self.last_target:
            raise StopForward  # every row of this forward is recorded: skip the layers after it

    def expert_output(self, layer: int, expert: int, token_idx: torch.Tensor, raw_output: torch.Tensor) -> None:
        """Not needed."""

    def end_chunk(self) -> None:
        """Hand the rows of the finished forward pass to the writer."""
        want = len(self.layers) * 4
        if len(self._rows) != want:
            raise DataError(f"a forward pass recorded {len(self._rows)} of {want} estimator tensors",
                            "the runner did not report every served layer; is the model loaded in exact mode?")
        self.writer.add(self._rows)
        self._rows = {}


class _Tee:
    """Forwards observer calls to several observers."""

    def __init__(self, *observers) -> None:
        self.observers = observers

    def routing(self, *args) -> None:
        for o in self.observers:
            o.routing(*args)

    def expert_output(self, *args) -> None:
        for o in self.observers:
            o.expert_output(*args)


def run_collection(om, chunks: list[list[int]], observer, collector: StateCollector, stage: str,
                   progress: Progress | None = None) -> None:
    """Each chunk as an independent prefill with ``observer`` attached; rows handed over per chunk."""
    run_chunks(om, chunks, observer, stage, progress, after_chunk=collector.end_chunk)


def collect_states(om, plan, manifest: StatesManifest, predictors: dict[str, NextLayerPredictor], folder: Path,
                   vectors: torch.Tensor | None = None, progress: Progress | None = None,
                   shard_bytes: int = SHARD_BYTES, truncate: bool = True) -> StatesManifest:
    """Run ``plan``'s train and held-out chunks through ``om``; write shards and the manifest to ``folder``.

    Args:
        om: the loaded model (exact mode).
        plan: a ChunkPlan (calib -> train rows, heldout -> held-out rows).
        manifest: identity fields filled in; counts, shards and baseline are filled here.
        predictors: "router" and, with a calibration, "quasi"; the one named ``manifest.input`` makes the states.
        folder: the states folder (created; earlier states in it are removed first).
        vectors: [S, E, H] default vectors of the served layers (input "quasi"), saved beside the shards.
        shard_bytes: bytes of states per shard.
        truncate: end each training forward at the last target layer's router (the fast path);
            False runs every layer (the slow reference). Both write the same rows.
    """
    from moespec.tempfiles import lock_fd
    from moespec.fsutil import check_free_space

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lock = lock_fd(folder)  # `moespec models --clean` leaves a collection that runs alone
    try:
        clear_states(folder)  # what a killed collection left
        check_free_space(folder, states_bytes(plan, manifest))  # said before the collection, not after it
        return _collect(om, plan, manifest, predictors, folder, vectors, progress, shard_bytes, truncate)
    except BaseException:  # Ctrl-C, a full disk: shards without a manifest are never reused, so go now
        clear_states(folder)
        with contextlib.suppress(OSError):
            folder.rmdir()
        raise
    finally:
        if lock is not None:
            os.close(lock)


def _collect(om, plan, manifest: StatesManifest, predictors: dict[str, NextLayerPredictor], folder: Path,
             vectors: torch.Tensor | None, progress: Progress | None, shard_bytes: int,
             truncate: bool) -> StatesManifest:
    maker = predictors[manifest.input]
    with torch.inference_mode():
        train = ShardWriter(folder, "train", shard_bytes)
        collector = StateCollector(maker, manifest.layers, train, stop_early=truncate)
        run_collection(om, plan.calib, collector, collector, "collect", progress)
        train.flush()
        held = ShardWriter(folder, "heldout", shard_bytes)
        collector = StateCollector(maker, manifest.layers, held)
        scorer = RecallObserver(om.adapter, predictors)
        run_collection(om, plan.heldout, _Tee(collector, scorer), collector, "heldout", progress)
        held.flush()
    if vectors is not None:
        save_vectors(folder, vectors)
    manifest.tokens, manifest.heldout_tokens = train.rows, held.rows
    manifest.shards = {"train": train.names, "heldout": held.names}
    manifest.baseline = baseline_recall(scorer, maker, manifest.moe_layers)
    write_manifest(folder, manifest)
    return manifest


def states_bytes(plan, manifest: StatesManifest) -> int:
    """Bytes the states of ``plan``'s chunks take on disk: per token and served layer a bf16 state [H],
    the true logits [E] (f32), ids [K] (i64) and weights [K] (f32)."""
    tokens = sum(len(c) for c in [*plan.calib, *plan.heldout])
    row = manifest.hidden * 2 + manifest.experts * 4 + manifest.top_k * 12
    return tokens * len(manifest.layers) * row


def baseline_recall(scorer, predictor: NextLayerPredictor, moe_layers: list[int]) -> dict[str, list[float]]:
    """"<metric>/<name>" -> [M] recall per *source* layer l (the layer that predicts), NaN where none."""
    out = {}
    for name, per_target in scorer.counts.items():
        for metric in ("recall", "weighted_recall"):
            vals = []
            for layer in moe_layers:
                nxt = predictor.target(layer)
                c = per_target.get(nxt.layer) if nxt is not None else None
                vals.append(getattr(c, metric)() if c is not None else math.nan)
            out[f"{metric}/{name}"] = vals
    return out
