"""OffloadedModel: a transformers MoE model whose experts live in the host store, and its runtime.

Every sparse MoE block of the model instance is an OffloadedMoeBlock that hands its router input to
the layer runner (runtime/layer); the runner reads experts through the device cache (runtime/cache),
which copies them from the host store (runtime/host) through the transfer engine (runtime/transfer).
runtime/load.py builds one. What a job may change or watch, it does through OffloadedModel: the
policy (``use_policy``), an observer (``observing``), the routings (``recording_routings``), the
stats recorder (``set_recorder``); the MoE layers are ``layer_refs()``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from moespec.config import OnMiss, RuntimeConfig
from moespec.models.base import MoeAdapter, Routing
from moespec.predict.base import LayerRef
from moespec.runtime.cache.ledger import PrefetchLedger
from moespec.runtime.cache.slots import ExpertCache
from moespec.runtime.host.disk_store import DiskStore, check_on_miss
from moespec.runtime.host.store import ExpertStore
from moespec.runtime.layer.observer import Observer, RoutingLog
from moespec.runtime.layer.policy import LayerPolicy
from moespec.runtime.layer.runner import MoeLayerRunner
from moespec.runtime.misses.host_pool import HostExpertPool, default_host_threads
from moespec.runtime.misses.planner import MissPlanner, measure_costs
from moespec.runtime.stats import StatsRecorder
from moespec.runtime.threads import ThreadPlan


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
        adapter, store, cache, runner: the runtime parts (the runner is the runtime's own: jobs go
            through the methods below).
        device, dtype: where and how dense parts and slots live.
        path: the checkpoint folder.
        runtime_config: what it was loaded with.
        notes: one-line notes for the user about how it was loaded (e.g. a cache policy fallback).
        planner: the miss planner and its host pool, made when a policy first runs misses on the host
            (``--on-miss host|auto``); None until then.
        compiled: the compiled dense path (runtime/compile.py) when ``--compile`` put one in, else None.
        threads: the thread plan of its forwards (runtime/threads.py; ``threads.enabled = False``: serial).
        dense: the dense linears' decode path and stored weights (runtime/dense.py), or None.
        norms: the native RMSNorms, which also record r_l (runtime/norm_call.py), or None.
        decode: the decoder layers' lean decode steps (runtime/decode_layer.py), or None.
        step: the one-token forward of the whole model (runtime/decode_model.py), or None.
        routers: the softmax routers' native selection (runtime/router_call.py), or None.
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
    planner: MissPlanner | None = None
    compiled: object | None = None  # runtime.compile.CompiledDense when decode steps run compiled
    threads: ThreadPlan | None = None  # who runs where in a forward (runtime/threads.py); set in __post_init__
    dense: object | None = None  # runtime.dense.DensePath
    norms: object | None = None  # runtime.norm_call.NormPath
    decode: object | None = None  # runtime.decode_layer.DecodePath
    step: object | None = None  # runtime.decode_model.ModelStep
    routers: object | None = None  # runtime.router_call.RouterPath

    def __post_init__(self) -> None:
        if self.threads is None:
            self.threads = ThreadPlan(self.device)

    # --- what the MoE layers run with ------------------------------------------------------
    @property
    def policy(self) -> LayerPolicy:
        """How the MoE layers run now."""
        return self.runner.policy

    def use_policy(self, policy: LayerPolicy) -> None:
        """Run the MoE layers with ``policy`` from the next forward on. The first policy that runs
        misses on the host starts the host pool and benchmarks the costs (misses.planner.measure_costs).

        Raises:
            OptionError: the host cannot compute this model's experts, or they are on disk (names
                --on-miss).
        """
        if policy.on_miss != OnMiss.FETCH and isinstance(self.store, DiskStore):
            check_on_miss(policy.on_miss)  # a host-computed miss needs its row in RAM (disk_tier.py)
        if policy.on_miss != OnMiss.FETCH and self.planner is None:
            first = self.model.model.layers[self.store.moe_layers[0]].mlp
            what = f"{getattr(self.config, 'model_type', 'this model')} {str(self.dtype).removeprefix('torch.')}"
            threads = self.runtime_config.host_threads or default_host_threads(self.device)
            pool = HostExpertPool(self.store, self.device, threads)
            try:  # host times on a worker: one intra-op thread and the CPU kernels, as its jobs run
                costs = measure_costs(self.store, self.cache.engine, self.device, self.dtype, first.act_fn, what,
                                      pool)
            except BaseException:
                pool.close()
                raise
            self.planner = MissPlanner(costs, pool)
        self.runner.use_policy(policy, self.planner)

    @property
    def recorder(self) -> StatsRecorder:
        """The stats recorder in use."""
        return self.runner.recorder

    def set_recorder(self, recorder: StatsRecorder) -> None:
        """Swap the stats recorder (NullRecorder to stop recording); wires it to the transfer engine."""
        wire_recorder(recorder, self.cache.engine)
        self.runner.recorder = recorder

    @contextlib.contextmanager
    def observing(self, observer: Observer) -> Iterator[Observer]:
        """Hand every MoE layer's routing and expert outputs to ``observer`` (layer/observer.py) until
        the block ends; the observer before it is attached again afterwards."""
        runner = self.runner
        before, runner.observer = runner.observer, observer
        try:
            yield observer
        finally:
            runner.observer = before

    @contextlib.contextmanager
    def recording_routings(self) -> Iterator[dict[int, Routing]]:
        """Within the block, the yielded dict holds, after each forward, the routing every MoE layer
        ran with (layer -> Routing, ids/weights [T, K]; an observer, so no other one runs meanwhile)."""
        log = RoutingLog()
        with self.observing(log):
            yield log.routings

    def layer_refs(self) -> list[LayerRef]:
        """The MoE layers, in order, as predictors and observers see them (router input norm, block)."""
        layers = self.model.model.layers
        return [LayerRef(layer=i, norm=layers[i].post_attention_layernorm, block=layers[i].mlp)
                for i in self.store.moe_layers]

    # --- the state a forward leaves ------------------------------------------------------------
    @property
    def ledger(self) -> PrefetchLedger:
        """The prefetch pins held for later layers."""
        return self.runner.ledger

    def reset_step(self, prefill: bool = False) -> None:
        """Drop what a forward left behind (prefetch pins, predictions); the engine does it before each.

        ``prefill``: the next forward is a prefill (exact in every mode, even a one-token one)."""
        self.runner.reset_step(prefill)

    def token_started(self, input_ids: torch.Tensor) -> torch.Tensor:
        """A forward of ``input_ids`` [1, T] starts (after ``reset_step`` and the recorder's
        ``begin_step``): the runner predicts a decode step's first MoE layer from the embedding rows.
        Returns those rows [T, H] (a one-token forward starts from them: decode_model.py)."""
        embedded = self.model.get_input_embeddings()(input_ids).reshape(input_ids.shape[-1], -1)  # [T, H]
        self.runner.token_started(embedded)
        return embedded

    def one_token_logits(self, input_ids: torch.Tensor, cache, cache_kw: str,
                         embedded: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits [1, 1, V] of the one token ``input_ids`` [1, 1] through the lean whole-model step
        (runtime/decode_model.py), or None where it does not apply (then run ``model(...)``)."""
        if self.step is None or self.compiled is not None:
            return None
        return self.step.logits(input_ids, cache, cache_kw, embedded)

    def abort(self) -> None:
        """After a forward that raised: cancel queued copies, drop every pin and the forward's state."""
        self.runner.abort()

    def drop_prefetches(self) -> int:
        """After a generation stopped between tokens: cancel the queued prefetch copies and drop the
        prefetch pins (MoeLayerRunner.drop_prefetches); returns the copies cancelled before they ran."""
        return self.runner.drop_prefetches()

    def max_context(self) -> int:
        """The model's context length in tokens."""
        return int(getattr(self.config, "max_position_embeddings", 0) or 2**31)

    def close(self) -> None:
        """Finish every copy and host job, stop the transfer engine, then unpin the host store."""
        if self.planner is not None:
            self.planner.close()
        self.threads.close()
        self.cache.engine.close()
        self.store.close()


def wire_recorder(recorder: StatsRecorder, engine) -> None:
    """A recording recorder synchronizes through the engine before reading clocks; the engine makes
    timing events only while one records."""
    if recorder.enabled:
        recorder.synchronize = engine.synchronize
    engine.set_timing(recorder.enabled)
