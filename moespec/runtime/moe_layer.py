"""One MoE layer through the expert cache: routing, prefetch of the next layer, streamed compute.

Shapes: T tokens, H hidden, K top-k, E experts.

Order inside MoE layer l at a decode step (the copy of l+1 overlaps l's expert compute):
  1. routing of l: the true router (exact, guarded, on the device), or the prediction made at l-1
     (speculative, its ids already on the host);
  2. the predictor turns r_l (and l's true or speculated routing) into the routing of l+1 (under
     ``--on-miss auto`` in exact/guarded mode only where the miss planner says it pays);
  3. ONE host read: l's expert ids (guarded: the guard's signals) with l+1's predicted ids;
     guarded mode then decides on the host which experts run (guard.py);
  4. prefetch pins of l that the routing does not use are released (counted as wasted);
  5. l's experts are acquired: hits pinned, misses copied on demand (as many as slots allow);
  6. l+1's predicted experts are prefetched (after l's demand copies, which go first); resident
     ones are pinned first, then the others copied (cache.py's prefetch rule);
  7. l's experts run in the order their copies land; each slot is released after use and the
     freed slot takes the next missing expert (so a prefill touching every expert streams the
     whole layer through a small cache in one pass). Misses that ``--on-miss host|auto`` sends to
     the host start on the host pool before the device's experts and are summed after them
     (miss_policy.py, host_compute.py): the sum is the same TopkSum either way.
A prefill reads only the per-expert pair counts (one argsort grouping, experts.group_by_expert).
Statistics computed on the device (recall, skipped mass) are read once per step at end_step, so
a layer costs at most one host sync in every mode. Prediction and approximate modes apply to
decode steps (T == 1); prefill is always exact.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from moespec.config import ExecuteMode, GuardRule, OnMiss
from moespec.errors import BudgetError
from moespec.models.base import MoeAdapter, Routing
from moespec.predict.base import NextLayerPredictor
from moespec.runtime.cache import ExpertCache
from moespec.runtime.experts import TopkSum, gated, group_by_expert, sum_one_token
from moespec.runtime.guard import guard_signals, plan_guard, signals_length, substituted_routing
from moespec.runtime.routing_stats import record_recall, record_skipped
from moespec.runtime.stats import LayerStats, StatsRecorder
from moespec.runtime.transfer import Span


@dataclass(frozen=True)
class _Prediction:
    """A predicted routing (ids/weights [1, K] on the device) and its ids already read to the host."""

    routing: Routing
    host_ids: list[int]


class MoeLayerRunner:
    """Runs MoE layers of one model instance; holds the cross-layer state of one forward pass.

    Args:
        adapter: the architecture adapter.
        cache: the device expert cache.
        predictor: next-layer predictor (NoPredictor for `none`).
        execute: execution mode on wrong predictions.
        fetch_threshold: τ of the guarded mode; ``guard_rule`` and ``guard_substitute`` (attributes,
            set after construction) say how it is applied (guard.py).
        recorder: stats recorder (NullRecorder when nobody listens).
    """

    def __init__(self, adapter: MoeAdapter, cache: ExpertCache, predictor: NextLayerPredictor,
                 execute: ExecuteMode, fetch_threshold: float, recorder: StatsRecorder) -> None:
        self.adapter = adapter
        self.cache = cache
        self.predictor = predictor
        self.execute = execute
        self.fetch_threshold = fetch_threshold
        self.guard_rule = GuardRule.BUDGET  # load_offloaded sets both from the RuntimeConfig
        self.guard_substitute = True
        self.recorder = recorder
        self.expert_bytes = cache.store.expert_bytes
        self.residual: dict[int, torch.Tensor] = {}  # layer -> r_l [.., H], set by a norm pre-hook
        self.predicted: dict[int, _Prediction] = {}  # target layer -> predicted routing (+ host ids)
        self.prefetch_pins: dict[int, list[int]] = {}  # target layer -> slots pinned by prefetch
        self.routings: dict[int, Routing] = {}  # layer -> routing that ran (for oracle/calibration)
        self.record_routing = False
        # Where misses run (--on-miss): FETCH, or the host pool + cost model (miss_policy.MissPlanner).
        self.on_miss = OnMiss.FETCH
        self.host = None
        self._predict_s = 0.0  # the running layer's prediction time (auto: MissPlanner.observe_predict)
        # Optional observer (calibration, estimator data collection): gets .routing(layer, x,
        # residual, routing) and .expert_output(layer, expert, token_idx, raw_output); None = free.
        self.observer = None

    def reset_step(self) -> None:
        """Drop per-forward state; release prefetch pins a previous forward left behind."""
        self._release_prefetch_pins(cancel=False)
        if self.host is not None:
            self.host.layer_started(new_step=True)
        self.predicted.clear()
        self.residual.clear()
        self.routings.clear()

    def abort(self) -> None:
        """Recover from a forward that ended in an exception (Ctrl-C between or inside layers).

        Cancels the queued copies, drops every cache pin (running layer and prefetch alike) and
        the per-forward state, so the next forward starts as after a finished one.
        """
        self.cache.abort()
        self._clear_forward_state()
        self.routings.clear()

    def drop_prefetches(self) -> int:
        """After a generation stopped between tokens (client gone, stop string): drop the prefetches it
        left behind, so the next request starts with every slot evictable and an idle link.

        Queued copies are cancelled before they start (no bytes move); copies already running or
        finished stay in their slots as ordinary cached experts, only their prefetch pins drop. Unlike
        ``abort`` (a forward that raised) nothing else is touched. Safe when nothing is pending.

        Returns:
            the number of copies cancelled before they ran.
        """
        cancelled = self._release_prefetch_pins(cancel=True)
        self._clear_forward_state()
        return cancelled

    def _release_prefetch_pins(self, cancel: bool) -> int:
        """Release every prefetch pin (``cancel``: first drop copies not started yet); returns how many
        were dropped. A copy that ran stays in its slot as an unused prediction."""
        cancelled = 0
        for slots in self.prefetch_pins.values():
            for slot in slots:
                if cancel and self.cache.cancel_prefetch(slot):
                    cancelled += 1
                else:
                    self.cache.unused_prefetch(slot)
                self.cache.release(slot)
        self.prefetch_pins.clear()
        return cancelled

    def _clear_forward_state(self) -> None:
        self.prefetch_pins.clear()
        self.predicted.clear()
        self.residual.clear()

    # ------------------------------------------------------------------------------------
    def run(self, block, x: torch.Tensor) -> torch.Tensor:
        """Routed (+ shared) MoE output [T, H] of ``block`` for router input ``x`` [T, H]."""
        stats = self.recorder.layer(block.layer)
        if self.host is not None:
            self.host.layer_started(new_step=x.shape[0] != 1)  # decode layers feed the layer-time average
        if x.shape[0] == 1:
            out = self._decode(block, x, stats)
        else:
            out = self._prefill(block, x, stats)
        shared = self.adapter.shared_output(block, x)
        return out if shared is None else out + shared

    def _observe(self, layer: int, x: torch.Tensor, residual: torch.Tensor | None, routing: Routing) -> None:
        """Hand the routing that runs to the recorder of routings and the observer (before any acquire)."""
        if self.record_routing:
            self.routings[layer] = routing
        if self.observer is not None:
            self.observer.routing(layer, x, residual, routing)

    # --- prefill: always exact, experts grouped by one argsort -------------------------------
    def _prefill(self, block, x: torch.Tensor, stats: LayerStats) -> torch.Tensor:
        layer = block.layer
        self.predicted.pop(layer, None)
        routing = self.adapter.route(block, x)
        self._observe(layer, x, self.residual.get(layer), routing)
        groups = group_by_expert(routing.ids, self.adapter.num_experts())  # the layer's one host read
        acc = TopkSum(x, routing.weights)

        def inputs(e: int) -> torch.Tensor:
            return x[groups.positions(e)[0]]  # [t, H]

        def put(e: int, raw: torch.Tensor) -> None:  # raw [t, H], from a slot or from the host
            tok, kpos, flat = groups.positions(e)  # [t] each
            if self.observer is not None:
                self.observer.expert_output(layer, e, tok, raw)
            acc.put_pairs(flat, gated(raw, routing.weights[tok, kpos, None]))

        tokens = {e: end - start for e, (start, end) in groups.spans.items()}
        self._stream(layer, groups.experts, stats, _Work(inputs, put, block.act_fn, tokens.__getitem__), None)
        return acc.result()

    # --- decode: one token, every mode -------------------------------------------------------
    def _decode(self, block, x: torch.Tensor, stats: LayerStats) -> torch.Tensor:
        layer = block.layer
        predicted = self.predicted.pop(layer, None)
        routing, host_ids = self._decode_routing(block, x, predicted, stats)
        residual = self.residual.pop(layer, None)
        nxt = None
        gated_predict = self._prefetch_gated()
        if residual is not None and (not gated_predict or self.host.prefetch_pays()):
            t0 = time.perf_counter()
            # `used` is the true routing in exact/guarded, as NextLayerPredictor says
            nxt = self.predictor.predict(layer, residual.reshape(-1, residual.shape[-1]), routing)
            self._predict_s = time.perf_counter() - t0
        guarded = host_ids is None and self.execute == ExecuteMode.GUARDED
        # The layer's one host read: what runs here and what l+1 is predicted to need, together
        # (float64 in guarded mode, whose signals carry gate weights; int64 otherwise).
        dtype = torch.float64 if guarded else routing.ids.dtype
        parts = []
        if host_ids is None:
            parts.append(guard_signals(routing) if guarded else routing.ids.reshape(-1))
        if nxt is not None:
            parts.append(nxt.ids.reshape(-1).to(dtype))
        got = torch.cat(parts).tolist() if parts else []
        if host_ids is None:
            k = routing.ids.shape[-1]
            n = signals_length(k, routing.logits.shape[-1]) if guarded else k
            head, got = got[:n], [int(v) for v in got[n:]]
            host_ids = [int(v) for v in head[:k]]
            if guarded:
                routing, host_ids = self._guard(layer, routing, head, host_ids, stats)
        self._observe(layer, x, residual, routing)
        k_of = {e: k for k, e in enumerate(host_ids)}
        weighted: list = [None] * len(host_ids)  # [1, H] per top-k position

        def put(e: int, raw: torch.Tensor) -> None:  # raw [1, H], from a slot or from the host
            if self.observer is not None:
                self.observer.expert_output(layer, e, torch.zeros(1, dtype=torch.long, device=x.device), raw)
            weighted[k_of[e]] = gated(raw, routing.weights[:, k_of[e] : k_of[e] + 1])  # [1, H]

        prefetch = None
        if nxt is not None:
            pred = _Prediction(nxt, got)
            prefetch = lambda: self._prefetch_next(layer, pred)  # noqa: E731 - after l's demand copies
        self._stream(layer, sorted(k_of), stats, _Work(lambda e: x, put, block.act_fn, lambda e: 1), prefetch)
        return sum_one_token(weighted, x)

    def _prefetch_gated(self) -> bool:
        """Auto mode in exact/guarded execution: the miss planner decides per layer whether predicting
        pays (MissPlanner.prefetch_pays). A speculative layer runs its prediction, so it always predicts."""
        return self.on_miss == OnMiss.AUTO and self.host is not None and self.execute != ExecuteMode.SPECULATIVE

    def _decode_routing(self, block, x: torch.Tensor, predicted: _Prediction | None,
                        stats: LayerStats) -> tuple[Routing, list[int] | None]:
        """(true or speculated routing [1, K], its host ids when already known); counters stay on the device."""
        rec = self.recorder
        speculate = predicted is not None and self.execute == ExecuteMode.SPECULATIVE
        true = None
        if not speculate or rec.enabled:
            true = self.adapter.route(block, x)  # in speculative mode only to measure recall
        if predicted is not None and rec.enabled:
            record_recall(rec, stats, predicted.routing, true)
        if speculate:
            if true is not None:
                record_skipped(rec, stats, predicted.routing, true)
            return predicted.routing, predicted.host_ids
        return true, None

    def _guard(self, layer: int, true: Routing, signals: list[float], ids: list[int],
               stats: LayerStats) -> tuple[Routing, list[int]]:
        """Guarded mode: the routing that runs and its host ids, decided from the signals already read."""
        plan = plan_guard(signals, len(ids), self.cache.resident_experts(layer), self.fetch_threshold,
                          self.guard_rule, self.guard_substitute)
        stats.skipped += plan.skipped
        stats.skipped_mass += plan.skipped_mass
        stats.substituted += plan.substituted
        if plan.run is None:
            return true, ids
        return substituted_routing(true, plan.run), plan.run

    # --- cache traffic and the streamed compute ----------------------------------------------
    def _release_unused_prefetch(self, layer: int, needed: set[int], stats: LayerStats) -> list[int]:
        keep = []
        for slot in self.prefetch_pins.pop(layer, []):
            key = self.cache.key_of(slot)
            if key is not None and key[1] in needed:
                keep.append(slot)
                continue
            if self.cache.cancel_prefetch(slot):
                # The copy never started: no bytes moved, the slot is free again.
                stats.prefetched -= 1
                stats.prefetch_cancelled += 1
                stats.h2d_bytes -= self.expert_bytes
            elif self.cache.unused_prefetch(slot):
                stats.prefetch_wasted += 1
            self.cache.release(slot)
        return keep

    def _prefetch_next(self, layer: int, pred: _Prediction) -> None:
        t0 = time.perf_counter()
        target = self.predictor.target(layer).layer
        self.predicted[target] = pred
        tstats = self.recorder.layer(target)
        pins = []
        wanted = sorted(set(pred.host_ids))
        budget = None
        if self.on_miss == OnMiss.AUTO and self.host is not None:
            # Auto: a miss never waits on the link, so copy only what the budget admits (highest-weight
            # predictions first); the rest is computed on the host there. Resident ones cost no copy.
            budget = self.host.prefetch_budget(self.cache.copies_in_flight())
            wanted = list(dict.fromkeys(pred.host_ids))
        resident = set(self.cache.resident_experts(target))
        # Resident predictions are pinned first, so no copy of this prediction evicts one of them
        # (as a layer pins its hits before its misses; cache.py's rule).
        wanted = self.cache.resident_first(target, wanted)
        for e in wanted:
            if budget is not None and e not in resident:
                if budget == 0:
                    continue
                budget -= 1
            got = self.cache.prefetch((target, e))
            if got is None:
                break  # no free slot: prefetch is best effort
            slot, copied = got
            pins.append(slot)
            if copied:
                tstats.prefetched += 1
                tstats.h2d_bytes += self.expert_bytes
        self.prefetch_pins[target] = pins
        if self._prefetch_gated():
            self.host.observe_predict((self._predict_s + time.perf_counter() - t0) * 1e3)

    def _stream(self, layer: int, experts: list[int], stats: LayerStats, work: "_Work", prefetch) -> None:
        """Acquire ``experts`` (ascending ids) of ``layer``, run ``prefetch()`` once l's demand copies are
        queued, compute each on the device in the order their copies land (``work.put(e, raw [t, H])``).

        Misses the miss planner sends to the host (``--on-miss host|auto``) start on the host pool
        first and are collected after the device's experts, so both compute at the same time.
        """
        cache, rec = self.cache, self.recorder
        layout = cache.store.layout.for_layer(layer)
        timed = self.host is not None and self.on_miss == OnMiss.AUTO and self.host.costs.shared
        predicted_here = layer in self.prefetch_pins  # a layer that was predicted (its usefulness is measured)
        used = 0
        kept_prefetch = self._release_unused_prefetch(layer, set(experts), stats)
        # Resident experts first (no wait), then misses in id order.
        resident = cache.resident_experts(layer)
        host_jobs = self._start_host(layer, experts, resident, stats, work)
        device = [e for e in experts if e not in host_jobs]
        pending = deque(cache.resident_first(layer, device))
        in_flight: deque = deque()

        def fill() -> None:
            nonlocal used
            while pending:
                got = cache.acquire((layer, pending[0]))
                if got is None:
                    return
                in_flight.append((pending.popleft(), got.slot))
                if got.hit:
                    stats.hits += 1
                    stats.prefetch_used += got.prefetched
                    used += got.prefetched
                else:
                    stats.misses += 1
                    stats.h2d_bytes += self.expert_bytes

        fill()
        for slot in kept_prefetch:  # now pinned by acquire as well
            cache.release(slot)
        if prefetch is not None:
            prefetch()
        while in_flight:
            e, slot = in_flight.popleft()
            rec.span(stats, "stall_ms", cache.wait(slot))
            t0 = cache.engine.mark() if rec.enabled or timed else None
            work.put(e, layout.forward(work.inputs(e), cache.row(slot), work.act))  # [t, H] from the slot
            if rec.enabled or timed:
                span = Span(t0, cache.engine.mark())
                rec.span(stats, "compute_ms", span)
                if timed:  # synchronous on a shared (CPU) device: the main thread's real cost per expert
                    self.host.costs.observe_device(work.tokens(e), span.ms())
            cache.release(slot)
            fill()
            if pending and not in_flight:
                raise BudgetError(
                    f"layer {layer} needs an expert but all {cache.num_slots} cache slots are pinned",
                    "raise --cache-experts / --gpu-memory",
                )
        if predicted_here and self._prefetch_gated():
            self.host.observe_used(used)
        for e, job in host_jobs.items():  # ascending ids; the sum's order is fixed by put's positions
            done = job.result()
            rec.span(stats, "host_ms", Span(done.start, done.end))
            self.host.observe(done)
            work.put(e, done.raw)

    def _start_host(self, layer: int, experts: list[int], resident: set[int], stats: LayerStats,
                    work: "_Work") -> dict:
        """Submit the experts the miss planner sends to the host; returns {expert: HostJob}."""
        if self.on_miss == OnMiss.FETCH or self.host is None:
            return {}
        cache = self.cache
        misses = [(e, work.tokens(e)) for e in experts if e not in resident]
        landed, in_flight, queued, ages = [], [], 0, {}  # landed: may go to the host on a shared processor
        if self.on_miss == OnMiss.AUTO:
            for e in experts:
                if e in resident:
                    (landed if cache.landed((layer, e)) else in_flight).append((e, work.tokens(e)))
            ages = {e: cache.copy_age_ms((layer, e)) for e, _ in in_flight}
            queued = cache.copies_in_flight() - len(in_flight)
        plan = self.host.plan(self.on_miss, landed, in_flight, misses, max(queued, 0), ages)
        chosen = [e for e in experts if e in plan.host]
        if not chosen:
            return {}
        jobs = {}
        for job in self.host.pool.submit_layer(layer, [(e, work.inputs(e)) for e in chosen], work.act):
            stats.host_computed += 1
            stats.d2h_bytes += job.d2h_bytes
            stats.host_h2d_bytes += job.h2d_bytes
            jobs[job.expert] = job
        return jobs


@dataclass(frozen=True)
class _Work:
    """What _stream computes for each expert: its inputs [t, H], where its raw output [t, H] goes,
    the block's activation, and its token count t (host int)."""

    inputs: object
    put: object
    act: object
    tokens: object
