"""Independent prefill chunks through the runtime with an observer attached: the pass the jobs make.

Shapes: M MoE layers, T tokens of one chunk.

`moespec calibrate` collects default vectors and frequencies, and scores predictors, this way;
`moespec train-estimator` collects estimator states. Every chunk is an independent prefill (fresh
KV cache, exact mode), so a model that does not fit the device is streamed layer by layer through
the expert cache. An observer may end a forward early by raising :class:`StopForward`.
"""

from __future__ import annotations

from typing import Callable

import torch

from moespec.predict.base import NextLayerPredictor
from moespec.predict.recall import METRICS, RecallObserver
from moespec.runtime.engine import Engine
from moespec.runtime.model import OffloadedModel

# (stage, tokens done, tokens total) after every chunk; stage names the pass ("calibrate", "heldout").
Progress = Callable[[str, int, int], None]


class StopForward(Exception):
    """Raised by an observer to end a prefill once it has recorded everything it needs.

    ``run_chunks`` catches it: the layers after the raising one (and the LM head) do not run, which
    is how estimator state collection skips the layers beyond its last target. Raise it only from
    ``observer.routing`` (before the layer acquires cache slots), so no slot stays pinned.
    """


def run_chunks(om: OffloadedModel, chunks: list[list[int]], observer, stage: str,
               progress: Progress | None = None, after_chunk=None) -> None:
    """Run each chunk as an independent prefill with ``observer`` attached to the MoE layers.

    ``after_chunk()`` (optional) is called after each chunk's forward, e.g. to flush collected rows.
    The observer may end a forward early by raising StopForward (that step is not recorded in stats).
    """
    engine = Engine(om)
    total, done = sum(len(c) for c in chunks), 0
    try:
        with om.observing(observer):
            for chunk in chunks:
                engine.reset()
                try:
                    engine.forward(chunk, "prefill")
                except StopForward:
                    om.reset_step()
                if after_chunk is not None:
                    after_chunk()
                done += len(chunk)
                if progress is not None:
                    progress(stage, done, total)
    finally:
        om.reset_step()
        engine.reset()


def measure_recall(om: OffloadedModel, chunks: list[list[int]], predictors: dict[str, NextLayerPredictor],
                   progress: Progress | None = None, ids_out: dict | None = None) -> dict[str, torch.Tensor]:
    """"<metric>/<predictor>" -> [M] float32 per predicted MoE layer (NaN for the first), over ``chunks``.

    ``ids_out`` (optional) receives the true ids, layer -> [T, K] per chunk.
    """
    observer = RecallObserver(om.adapter, predictors)
    run_chunks(om, chunks, observer, "heldout", progress)
    if ids_out is not None:
        ids_out.update(observer.ids)
    layers = om.store.moe_layers
    out = {}
    for name, per_layer in observer.counts.items():
        for metric in METRICS:
            vals = [getattr(per_layer[layer], metric)() if layer in per_layer else float("nan") for layer in layers]
            out[f"{metric}/{name}"] = torch.tensor(vals, dtype=torch.float32)
    return out
