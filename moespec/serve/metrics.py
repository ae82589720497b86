"""Prometheus metrics of the server: requests, tokens, latency, and the expert cache per layer.

Latency follows the usual serving names (TTFT from the request's arrival to its first token,
queue wait included; TPOT per decode step). What other servers do not show comes from the
runtime's StatsRecorder after each generation, per MoE layer and phase (prefill / decode):
expert hits and misses, prefetched / wasted / cancelled prefetches, H2D bytes, stall and
compute seconds, recall@K counts; plus running per-layer hit rate and recall@K over decode
steps, and cache occupancy (slots used, resident experts per layer). Each server has its own
CollectorRegistry (no global state; tests can run several).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from moespec.runtime.cache.slots import ExpertCache
from moespec.runtime.stats import LayerStats
from moespec.serve.generate import FinishReason, Outcome
from moespec.serve.queue import Job

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
# LayerStats field -> (metric suffix, help, scale to the metric's unit)
_LAYER_COUNTERS = {
    "hits": ("expert_hits", "expert requests found in the cache (resident or in flight)", 1),
    "misses": ("expert_misses", "expert requests copied on demand", 1),
    "prefetched": ("prefetched_experts", "prefetch copies issued by the predictor", 1),
    "prefetch_wasted": ("prefetch_wasted_experts", "prefetched experts the layer did not use", 1),
    "prefetch_cancelled": ("prefetch_cancelled_experts", "mispredicted copies dropped before they ran", 1),
    "h2d_bytes": ("h2d_bytes", "bytes copied host to device", 1),
    "stall_ms": ("stall_seconds", "time compute waited for a copy", 1e-3),
    "compute_ms": ("expert_compute_seconds", "time spent computing experts", 1e-3),
    "recall_hits": ("recall_hits", "true top-K experts that were predicted (recall@K numerator)", 1),
    "recall_total": ("recall_slots", "true top-K experts checked against a prediction (recall@K denominator)", 1),
}


class ServerMetrics:
    """All metrics of one server, in their own registry."""

    def __init__(self) -> None:
        self.registry = reg = CollectorRegistry()
        self.requests = Counter("moespec_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=reg)
        self.prompt_tokens = Counter("moespec_prompt_tokens", "prompt tokens of finished generations", registry=reg)
        self.cached_tokens = Counter("moespec_prompt_cached_tokens", "prompt tokens reused from the KV cache",
                                     registry=reg)
        self.generation_tokens = Counter("moespec_generation_tokens", "tokens generated", registry=reg)
        self.cancelled = Counter("moespec_cancelled_requests", "generations stopped because the client left",
                                 registry=reg)
        self.rejected = Counter("moespec_rejected_requests", "requests refused with 429 (queue full)", registry=reg)
        self.ttft = Histogram("moespec_time_to_first_token_seconds", "request arrival to first token (queue included)",
                              buckets=_LATENCY_BUCKETS_S, registry=reg)
        self.tpot = Histogram("moespec_time_per_output_token_seconds", "wall time of each decode step",
                              buckets=_TOKEN_BUCKETS_S, registry=reg)
        self.queue_wait = Histogram("moespec_queue_wait_seconds", "time a request waited for the model",
                                    buckets=_LATENCY_BUCKETS_S, registry=reg)
        self.running = Gauge("moespec_requests_running", "generations running now (0 or 1)", registry=reg)
        self.waiting = Gauge("moespec_requests_waiting", "requests waiting in the queue", registry=reg)
        self.layer = {f: Counter(f"moespec_layer_{name}", f"per MoE layer and phase: {text}", ["layer", "phase"],
                                 registry=reg) for f, (name, text, _) in _LAYER_COUNTERS.items()}
        self.hit_rate = Gauge("moespec_layer_hit_rate", "hits / (hits + misses) over all decode steps so far",
                              ["layer"], registry=reg)
        self.recall = Gauge("moespec_layer_recall_at_k", "recall@K of the predictions over all decode steps so far",
                            ["layer"], registry=reg)
        self.cache_slots = Gauge("moespec_cache_slots", "expert slots in the device cache", registry=reg)
        self.cache_used = Gauge("moespec_cache_slots_used", "slots holding an expert", registry=reg)
        self.resident = Gauge("moespec_cache_resident_experts", "experts of each layer held in the cache", ["layer"],
                              registry=reg)
        self.disk_bytes = Gauge("moespec_disk_read_bytes", "expert bytes read from disk since load (disk tier)",
                                registry=reg)
        self.disk_gbps = Gauge("moespec_disk_read_gbps", "disk read GB/s achieved since load (disk tier)",
                               registry=reg)
        self._decode_totals: dict[int, LayerStats] = {}

    def set_queue(self, running: int, waiting: int) -> None:
        """The queue's state changed."""
        self.running.set(running)
        self.waiting.set(waiting)

    def observe_generation(self, job: Job, outs: list[Outcome]) -> None:
        """Record one finished request (its choices): latency, tokens, the recorder's per-layer steps."""
        self.queue_wait.observe(job.started_s - job.created_s)
        if outs and outs[0].first_token_s is not None:
            self.ttft.observe(outs[0].first_token_s - job.created_s)
        for out in outs:
            self.prompt_tokens.inc(out.prompt_tokens)
            self.cached_tokens.inc(out.cached_tokens)
            self.generation_tokens.inc(out.completion_tokens)
        if any(out.finish_reason == FinishReason.CANCELLED for out in outs):
            self.cancelled.inc()
        per: dict[tuple[int, str], LayerStats] = {}
        for step in (s for out in outs for s in out.steps):
            if step.kind == "decode":
                self.tpot.observe(step.wall_ms / 1e3)
            for layer, st in step.layers.items():
                per.setdefault((layer, step.kind), LayerStats()).add(st)
        for (layer, phase), st in per.items():
            for f, (_, _, scale) in _LAYER_COUNTERS.items():
                value = getattr(st, f)
                if value > 0:  # counters only go up (a cancelled copy never moved its bytes)
                    self.layer[f].labels(str(layer), phase).inc(value * scale)
            if phase == "decode":
                tot = self._decode_totals.setdefault(layer, LayerStats())
                tot.add(st)
                if tot.hits + tot.misses:
                    self.hit_rate.labels(str(layer)).set(tot.hits / (tot.hits + tot.misses))
                if tot.recall_total:
                    self.recall.labels(str(layer)).set(tot.recall_hits / tot.recall_total)

    def observe_cache(self, cache: ExpertCache) -> None:
        """Cache occupancy now (call from the thread that owns the cache)."""
        keys = cache.resident_keys()
        self.cache_slots.set(cache.num_slots)
        self.cache_used.set(len(keys))
        per_layer: dict[int, int] = {}
        for layer, _ in keys:
            per_layer[layer] = per_layer.get(layer, 0) + 1
        for layer in cache.store.moe_layers:
            self.resident.labels(str(layer)).set(per_layer.get(layer, 0))
        engine = cache.engine
        if hasattr(engine, "reads"):  # the disk reader (runtime/transfer/disk.py): the RAM tier is the cache
            busy = engine.busy_seconds()
            self.disk_bytes.set(engine.bytes_moved)
            self.disk_gbps.set(engine.bytes_moved / busy / 1e9 if busy > 0 else 0.0)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
