"""Per-step, per-layer statistics, and a no-op recorder with the same interface.

A step is one forward pass: the prefill of a prompt (T tokens) or one decode token (T = 1).
Times are resolved from Spans only at the end of a step, after the device was synchronised,
and counters computed on the device (recall hits, gate mass, skipped experts) stay device
tensors until then, read in one transfer: recording never adds a host sync inside a layer.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from moespec.runtime.transfer.base import Span


@dataclass
class LayerStats:
    """What happened at one MoE layer during one step.

    hits/misses count (token-independent) expert requests of the layer: a hit was resident (or in
    flight from a prefetch) when needed, a miss was copied on demand. prefetched counts copies
    the predictor issued for this layer that ran; prefetch_used/prefetch_wasted split them after it
    ran; prefetch_cancelled counts mispredicted copies dropped before they started (no bytes).
    recall_hits/recall_total: |predicted ∩ true top-K| and K summed over tokens; weighted_* the
    true gate mass covered. skipped: true top-K experts that did not run (speculative, guarded);
    skipped_mass: their share of the token's true top-K gate mass (renormalised weight, summed over
    tokens). host_computed: misses computed on the host from their store
    row (``--on-miss host|auto``; counted in neither hits nor misses); host_ms: their host time;
    d2h_bytes / host_h2d_bytes: the activations they sent to the host and the outputs that came back.
    predicted / predict_gated: decode visits at which this layer predicted the next one / at which
    the prediction gate (runtime/layer/gate.py) skipped that because it did not pay. Counters computed on the device wait in ``pending`` (as
    times wait in ``spans``) until end_step reads them all in one transfer.
    """

    hits: int = 0
    misses: int = 0
    prefetched: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0
    prefetch_cancelled: int = 0
    prefetched_ahead: int = 0  # of prefetched: copies issued two layers ahead (runtime/layer/ahead.py)
    h2d_bytes: int = 0
    stall_ms: float = 0.0
    compute_ms: float = 0.0
    recall_hits: int = 0
    recall_total: int = 0
    weighted_hit: float = 0.0
    weighted_total: float = 0.0
    skipped: int = 0
    skipped_mass: float = 0.0
    substituted: int = 0
    host_computed: int = 0
    host_ms: float = 0.0
    d2h_bytes: int = 0
    host_h2d_bytes: int = 0
    predicted: int = 0
    predict_gated: int = 0
    spans: list = field(default_factory=list, repr=False)  # (field name, Span), resolved at end_step
    pending: list = field(default_factory=list, repr=False)  # (field name, 0-dim tensor), read at end_step

    def add(self, other: "LayerStats") -> None:
        """Accumulate ``other`` into this one (spans and device counters must be resolved)."""
        for k, v in asdict(other).items():
            if k not in ("spans", "pending"):
                setattr(self, k, getattr(self, k) + v)


@dataclass
class StepStats:
    """One forward pass: kind "prefill" or "decode", T tokens, wall time, per-layer stats.

    reused_tokens (prefill): prompt tokens before these T whose keys/values came from the KV cache.
    """

    kind: str
    tokens: int
    wall_ms: float = 0.0
    layers: dict[int, LayerStats] = field(default_factory=dict)
    reused_tokens: int = 0

    def total(self) -> LayerStats:
        """Sum over layers."""
        out = LayerStats()
        for s in self.layers.values():
            out.add(s)
        return out


class StatsRecorder:
    """Collects StepStats. ``enabled`` is True; see NullRecorder for the free variant.

    Args:
        synchronize: called before reading clocks at the end of a step (the transfer engine's).
    """

    enabled = True

    def __init__(self, synchronize=lambda: None) -> None:
        self.synchronize = synchronize
        self.steps: list[StepStats] = []
        self._current: StepStats | None = None
        self._t0 = 0.0

    def begin_step(self, kind: str, tokens: int) -> None:
        """Start a step (before the forward pass)."""
        self._current = StepStats(kind=kind, tokens=tokens)
        self._t0 = time.perf_counter()

    def layer(self, layer: int) -> LayerStats:
        """The LayerStats of ``layer`` in the current step (created on first use)."""
        cur = self._current
        if cur is None:  # a forward outside begin/end (e.g. a warm-up call): keep it aside
            self.begin_step("other", 0)
            cur = self._current
        return cur.layers.setdefault(layer, LayerStats())

    def span(self, stats: LayerStats, name: str, span: Span | None) -> None:
        """Add ``span`` to ``stats.<name>`` (resolved at end_step)."""
        if span is not None:
            stats.spans.append((name, span))

    def count(self, stats: LayerStats, name: str, value: torch.Tensor) -> None:
        """Add the 0-dim device tensor ``value`` to ``stats.<name>`` at end_step (no sync now)."""
        stats.pending.append((name, value))

    def end_step(self) -> StepStats:
        """Synchronise, resolve spans and device counters, store and return the finished step."""
        self.synchronize()
        cur = self._current
        assert cur is not None, "end_step without begin_step"
        cur.wall_ms = (time.perf_counter() - self._t0) * 1e3
        for s in cur.layers.values():
            for name, span in s.spans:
                setattr(s, name, getattr(s, name) + span.ms())
            s.spans = []
        _resolve_pending(list(cur.layers.values()))
        self.steps.append(cur)
        self._current = None
        return cur

    def reset(self) -> None:
        """Forget all steps."""
        self.steps.clear()


class NullRecorder(StatsRecorder):
    """Same interface, records nothing: instrumentation costs nothing when nobody listens."""

    enabled = False

    def __init__(self) -> None:
        super().__init__()
        self._scratch = LayerStats()

    def begin_step(self, kind: str, tokens: int) -> None:
        pass

    def layer(self, layer: int) -> LayerStats:
        self._scratch = LayerStats()
        return self._scratch

    def span(self, stats: LayerStats, name: str, span: Span | None) -> None:
        pass

    def count(self, stats: LayerStats, name: str, value: torch.Tensor) -> None:
        pass

    def end_step(self) -> StepStats:
        return StepStats(kind="none", tokens=0)


def _resolve_pending(layers: list[LayerStats]) -> None:
    """Read every layer's pending device counters in one transfer per device, in recording order.

    float64 holds the int counts and float32 sums exactly, so the values equal int()/float() reads.
    """
    by_device: dict[torch.device, list[tuple[LayerStats, str, torch.Tensor]]] = {}
    for s in layers:
        for name, value in s.pending:
            by_device.setdefault(value.device, []).append((s, name, value))
        s.pending = []
    for items in by_device.values():
        values = torch.stack([v.reshape(()).to(torch.float64) for _, _, v in items]).tolist()  # one host read
        for (s, name, _), v in zip(items, values):
            old = getattr(s, name)
            setattr(s, name, old + (int(v) if isinstance(old, int) else v))


@dataclass(frozen=True)
class Summary:
    """Headline numbers over a set of steps.

    Attributes:
        prompt_tokens, new_tokens: counts (prompt_tokens: the prompt tokens computed, not reused).
        ttft_ms: wall time of the prefill step(s) (first token's logits ready).
        tpot_ms: mean wall time of a decode step (ms per output token).
        tokens_per_s: 1000 / tpot_ms.
        recall: recall@K of the predictions over decode steps (None without predictions).
        weighted_recall: true gate mass covered by the predictions (None without predictions).
        hit_rate: hits / (hits + misses) over decode steps.
        h2d_mb_per_token, stall_ms_per_token, compute_ms_per_token: per decode token.
        prefetch_wasted_per_token: prefetched experts never used, per decode token.
        skipped_per_token: true top-K experts not run per decode token (approximate modes).
        host_experts_per_token, host_ms_per_token: misses computed on the host, and their host ms.
        reused_tokens: prompt tokens whose keys/values came from the KV cache (multi-turn chat);
            the whole prompt is prompt_tokens + reused_tokens.
        disk: with the experts on disk (runtime/disk_tier.disk_numbers), disk bytes per token, the RAM
            tier's hit rate, disk stall ms per token, the disk read GB/s achieved; None otherwise.
    """

    prompt_tokens: int
    new_tokens: int
    ttft_ms: float
    tpot_ms: float
    tokens_per_s: float
    recall: float | None
    weighted_recall: float | None
    hit_rate: float
    h2d_mb_per_token: float
    stall_ms_per_token: float
    compute_ms_per_token: float
    prefetch_wasted_per_token: float
    skipped_per_token: float
    host_experts_per_token: float = 0.0
    host_ms_per_token: float = 0.0
    reused_tokens: int = 0
    disk: dict | None = None


def summarize(steps: list[StepStats]) -> Summary:
    """Summary of ``steps`` (prefill steps give TTFT, decode steps everything per token)."""
    prefill = [s for s in steps if s.kind == "prefill"]
    decode = [s for s in steps if s.kind == "decode"]
    tot = LayerStats()
    for s in decode:
        tot.add(s.total())
    n = max(len(decode), 1)
    tpot = sum(s.wall_ms for s in decode) / n if decode else 0.0
    return Summary(
        prompt_tokens=sum(s.tokens for s in prefill),
        new_tokens=len(decode) + (1 if prefill else 0),
        ttft_ms=sum(s.wall_ms for s in prefill),
        tpot_ms=tpot,
        tokens_per_s=1e3 / tpot if tpot > 0 else 0.0,
        recall=tot.recall_hits / tot.recall_total if tot.recall_total else None,
        weighted_recall=tot.weighted_hit / tot.weighted_total if tot.weighted_total else None,
        hit_rate=tot.hits / (tot.hits + tot.misses + tot.host_computed) if tot.hits + tot.misses + tot.host_computed
        else 0.0,
        h2d_mb_per_token=tot.h2d_bytes / n / 1e6,
        stall_ms_per_token=tot.stall_ms / n,
        compute_ms_per_token=tot.compute_ms / n,
        prefetch_wasted_per_token=tot.prefetch_wasted / n,
        skipped_per_token=tot.skipped / n,
        host_experts_per_token=tot.host_computed / n,
        host_ms_per_token=tot.host_ms / n,
        reused_tokens=sum(s.reused_tokens for s in prefill),
    )
