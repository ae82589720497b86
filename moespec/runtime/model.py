"""OffloadedModel: a transformers MoE model whose experts live in the host store, and its runtime.

Every sparse MoE block of the model instance is an OffloadedMoeBlock that hands its router input to
the layer runner (runtime/layer); the runner reads experts through the device cache (runtime/cache),
which copies them from the host store (runtime/host) through the transfer engine (runtime/transfer).
runtime/load.py builds one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from moespec.config import OnMiss, RuntimeConfig
from moespec.models.base import MoeAdapter
from moespec.predict.base import LayerRef
from moespec.runtime.cache.slots import ExpertCache
from moespec.runtime.host.store import ExpertStore
from moespec.runtime.layer.runner import MoeLayerRunner
from moespec.runtime.misses.host_pool import HostExpertPool, default_host_threads
from moespec.runtime.misses.planner import MissPlanner, measure_costs
from moespec.runtime.stats import StatsRecorder


class OffloadedMoeBlock(nn.Module):
    """Replaces one sparse MoE block of a model instance; returns what the original returns.

    Keeps the original's shared parts under their original names, so the checkpoint's dense tensor
    names still apply; the router is always the child ``gate`` (GPT-OSS's ``router`` is registered
    under that name and its adapter maps the checkpoint names). The experts live in the host store.
    """

    def __init__(self, original: nn.Module, layer: int, runner: MoeLayerRunner, adapter: MoeAdapter) -> None:
        super().__init__()
        for name, child in original.named_children():
            if name != "experts":
                self.add_module("gate" if name == adapter.router_attr else name, child)
        self.layer = layer
        self.act_fn = getattr(original.experts, "act_fn", None)  # None: the layout has its own (GPT-OSS)
        self._returns_scores = adapter.returns_router_scores
        self._runner = [runner]  # in a list: not a submodule, not in state_dict

    def forward(self, hidden_states: torch.Tensor):
        """hidden_states [B, S, H] (router input s_l) -> MoE output [B, S, H] (GPT-OSS: (output, None))."""
        shape = hidden_states.shape
        out = self._runner[0].run(self, hidden_states.reshape(-1, shape[-1])).reshape(shape)  # [B, S, H]
        # GPT-OSS's decoder layer unpacks (output, router_scores) and discards the scores.
        return (out, None) if self._returns_scores else out



@dataclass
class OffloadedModel:
    """A loaded model and its offloading runtime.

    Attributes:
        model: the transformers CausalLM (dense parts on ``device``, MoE blocks offloaded).
        config: its transformers config.
        adapter, store, cache, runner: the runtime parts.
        device, dtype: where and how dense parts and slots live.
        path: the checkpoint folder.
        notes: one-line notes for the user about how it was loaded (e.g. a cache policy fallback).
    """

    model: nn.Module
    config: object
    adapter: MoeAdapter
    store: ExpertStore
    cache: ExpertCache
    runner: MoeLayerRunner
    device: torch.device
    dtype: torch.dtype
    path: Path
    runtime_config: RuntimeConfig
    notes: list[str] = field(default_factory=list)

    @property
    def recorder(self) -> StatsRecorder:
        """The stats recorder in use."""
        return self.runner.recorder

    def set_recorder(self, recorder: StatsRecorder) -> None:
        """Swap the stats recorder (NullRecorder to stop recording); wires it to the transfer engine."""
        wire_recorder(recorder, self.cache.engine)
        self.runner.recorder = recorder

    def set_on_miss(self, mode: OnMiss) -> None:
        """Where cache misses run from now on; the first host/auto use starts the host pool and
        benchmarks the costs (misses.planner.measure_costs).

        Raises:
            OptionError: the host cannot compute this model's experts (names --on-miss).
        """
        runner = self.runner
        if mode != OnMiss.FETCH and runner.host is None:
            first = self.model.model.layers[self.store.moe_layers[0]].mlp
            what = f"{getattr(self.config, 'model_type', 'this model')} {str(self.dtype).removeprefix('torch.')}"
            costs = measure_costs(self.store, self.cache.engine, self.device, self.dtype, first.act_fn, what)
            threads = self.runtime_config.host_threads or default_host_threads(self.device)
            runner.host = MissPlanner(costs, HostExpertPool(self.store, self.device, threads))
        runner.on_miss = mode

    def layer_refs(self) -> list[LayerRef]:
        """The MoE layers, in order, as predictors and observers see them (router input norm, block)."""
        layers = self.model.model.layers
        return [LayerRef(layer=i, norm=layers[i].post_attention_layernorm, block=layers[i].mlp)
                for i in self.store.moe_layers]

    def max_context(self) -> int:
        """The model's context length in tokens."""
        return int(getattr(self.config, "max_position_embeddings", 0) or 2**31)

    def close(self) -> None:
        """Finish every copy and host job, stop the transfer engine, then unpin the host store."""
        if self.runner.host is not None:
            self.runner.host.close()
        self.cache.engine.close()
        self.store.close()


def _wire_recorder(recorder: StatsRecorder, engine) -> None:
    """A recording recorder synchronizes through the engine before reading clocks; the engine makes
    timing events only while one records."""
    if recorder.enabled:
        recorder.synchronize = engine.synchronize
    engine.set_timing(recorder.enabled)


def wire_recorder(recorder: StatsRecorder, engine) -> None:
    """A recording recorder synchronizes through the engine before reading clocks; the engine makes
    timing events only while one records."""
    if recorder.enabled:
        recorder.synchronize = engine.synchronize
    engine.set_timing(recorder.enabled)
