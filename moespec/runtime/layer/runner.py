"""One MoE layer through the expert cache: route, predict, one host read, plan misses, stream, prefetch, combine.

Shapes: T tokens, H hidden, K top-k, E experts.

A decode step of MoE layer l (``MoeLayerRunner._decode``; the copy of l+1 overlaps l's experts):
  route      the true router (exact, guarded), or the prediction made at l-1 (speculative);
  predict    the prefetcher turns r_l and l's routing into l+1's (prefetcher.py);
  host read  ONE read: l's expert ids (guarded: the guard's signals) with l+1's predicted ids;
             guarded mode then decides on the host which experts run (guard.py);
  plan       the ledger settles l's prefetch pins (runtime/cache/ledger.py); the miss handler
             starts the misses that run on the host pool (runtime/misses);
  stream     l's experts in the order their copies land, each slot freed for the next missing
             expert (runtime/cache/stream.py); after l's demand copies are queued, l+1's predicted
             experts are prefetched (resident ones pinned first, then copies);
  combine    the host's experts join the device's, summed as transformers sums (experts.py).
Before the first layer of a decode step, the new token's first MoE layer is predicted from its
embedding and prefetched (``token_started``; token_start.py).
A prefill is always exact: one argsort groups the pairs by expert (experts.group_by_expert), its
one host read is the per-expert counts. Statistics computed on the device (recall, skipped mass)
are read once per step at end_step, so a layer costs at most one host sync in every mode.
Prediction and approximate modes apply to decode steps (T == 1).

The runner's settings are one LayerPolicy (policy.py); the off cases are no-op twins (NoPrefetcher,
FetchMisses, Observer, NullRecorder), so no step asks whether a part is there.
"""

from __future__ import annotations

import torch

from moespec.config import ExecuteMode, OnMiss
from moespec.kernels import row_pool
from moespec.models.base import MoeAdapter, Routing
from moespec.predict.base import NoPredictor
from moespec.runtime.cache.ledger import PrefetchLedger
from moespec.runtime.cache.slots import ExpertCache
from moespec.runtime.cache.stream import acquire_resident, release_slots, stream
from moespec.runtime.layer.ahead import AheadPrefetch, NoAhead
from moespec.runtime.layer.experts import TopkSum, gated, group_by_expert, sum_one_token, sum_stacked
from moespec.runtime.layer.gate import PredictionGate, link_ms_per_copy
from moespec.runtime.layer.guard import guard_signals, plan_guard, signals_length, substituted_routing
from moespec.runtime.layer.observer import Observer
from moespec.runtime.layer.policy import LayerPolicy
from moespec.runtime.layer.prefetcher import NoPrefetcher, Prediction, Prefetcher
from moespec.runtime.layer.routing_stats import record_recall, record_skipped
from moespec.runtime.layer.token_start import TokenStart
from moespec.runtime.misses.handlers import miss_handler
from moespec.runtime.misses.planner import MissPlanner
from moespec.runtime.stats import LayerStats, StatsRecorder
from moespec.runtime.transfer.base import Span


class MoeLayerRunner:
    """Runs the MoE layers of one model instance; holds the cross-layer state of one forward pass.

    Args:
        adapter: the architecture adapter.
        cache: the device expert cache.
        ledger: the prefetch pins of ``cache``.
        recorder: stats recorder (NullRecorder when nobody listens).
        policy: the settings (``use_policy`` swaps them); planner: the host pool's miss planner, if any.
    """

    def __init__(self, adapter: MoeAdapter, cache: ExpertCache, ledger: PrefetchLedger, recorder: StatsRecorder,
                 policy: LayerPolicy, planner: MissPlanner | None = None) -> None:
        self.adapter = adapter
        self.cache = cache
        self.ledger = ledger
        self.recorder = recorder
        self.observer = Observer()
        self.residual: dict[int, torch.Tensor] = {}  # layer -> r_l [.., H], set by a norm pre-hook
        self._decode_tok = torch.zeros(1, dtype=torch.long, device=cache.slots.device)  # [1] token index
        self._prefill_forward = False  # set per forward by reset_step
        self._has_shared = type(adapter).shared_output is not MoeAdapter.shared_output  # a family with shared experts
        self.token_start = TokenStart(min(cache.store.moe_layers))  # kept across policies: its default vector
        self.use_policy(policy, planner)

    def use_policy(self, policy: LayerPolicy, planner: MissPlanner | None) -> None:
        """Run with ``policy`` from the next forward on (``planner``: required for --on-miss host/auto)."""
        self.policy = policy
        self.misses = miss_handler(policy.on_miss, planner, gate=policy.execute != ExecuteMode.SPECULATIVE)
        self.ahead = (AheadPrefetch(policy.predictor, self.ledger, self.adapter.top_k(), policy.ahead_recall)
                      if policy.ahead_recall is not None and not isinstance(policy.predictor, NoPredictor)
                      else NoAhead())
        if isinstance(policy.predictor, NoPredictor):
            self.prefetcher = NoPrefetcher()
        else:
            gated = (policy.prediction_gate and policy.execute != ExecuteMode.SPECULATIVE
                     and policy.on_miss != OnMiss.AUTO)  # auto: the miss planner's gate (misses/planner.py)
            gate = PredictionGate(link_ms_per_copy(self.cache)) if gated else None
            self.prefetcher = Prefetcher(policy.predictor, self.ledger, self.misses, gate)

    def reset_step(self, prefill: bool = False) -> None:
        """Drop per-forward state; release prefetch pins a previous forward left behind.

        ``prefill``: the coming forward is a prefill, exact in every mode even when it runs one
        token (a new chat turn or a resumed prompt can add exactly one token after the reused KV).
        """
        self._prefill_forward = prefill
        self.ledger.drop(cancel=False)
        self.misses.layer_started(True)
        self._clear_forward_state()

    def abort(self) -> None:
        """Recover from a forward that ended in an exception (Ctrl-C between or inside layers).

        Cancels the queued copies, drops every cache pin (running layer and prefetch alike) and
        the per-forward state, so the next forward starts as after a finished one.
        """
        self.cache.abort()
        self.ledger.forget()
        self._clear_forward_state()

    def drop_prefetches(self) -> int:
        """After a generation stopped between tokens (client gone, stop string): drop the prefetches it
        left behind, so the next request starts with every slot evictable and an idle link.

        Queued copies are cancelled before they start (no bytes move); copies already running or
        finished stay in their slots as ordinary cached experts, only their prefetch pins drop. Unlike
        ``abort`` (a forward that raised) nothing else is touched. Safe when nothing is pending.

        Returns:
            the number of copies cancelled before they ran.
        """
        cancelled = self.ledger.drop(cancel=True).cancelled
        self._clear_forward_state()
        return cancelled

    def _clear_forward_state(self) -> None:
        self.prefetcher.clear()
        self.ahead.clear()
        self.residual.clear()
        self.token_start.clear()

    def token_started(self, embedded: torch.Tensor) -> None:
        """A forward starts (after ``reset_step``) with the tokens whose embedding rows are ``embedded``
        [T, H]: a decode step predicts and prefetches its first MoE layer now (token_start.py)."""
        self.token_start.started(embedded)
        if embedded.shape[0] == 1 and not self._prefill_forward and self.policy.token_start:
            self.prefetcher.prefetch_first(self.token_start, self.recorder)

    # ------------------------------------------------------------------------------------
    def run(self, block, x: torch.Tensor) -> torch.Tensor:
        """Routed (+ shared) MoE output [T, H] of ``block`` for router input ``x`` [T, H]."""
        stats = self.recorder.layer(block.layer)
        self.token_start.observe(block.layer, self.residual.get(block.layer))  # its default vector
        decode = x.shape[0] == 1 and not self._prefill_forward  # prefill is exact (design.md)
        self.misses.layer_started(not decode)  # decode layers feed the layer-time average
        # The thread plan (runtime/threads.py): the shared expert on an idle row worker while this
        # thread routes and computes the routed experts; None: computed here, after them.
        pool = row_pool.active() if self._has_shared else None
        beside = pool is not None and pool.beside  # off by default: no wrapper built per layer then
        ticket = pool.start(_with_modes(lambda: self.adapter.shared_output(block, x))) if beside else None
        out = self._decode(block, x, stats) if decode else self._prefill(block, x, stats)
        shared = self.adapter.shared_output(block, x) if ticket is None else ticket.result()
        return out if shared is None else out + shared

    # --- decode: one token, every mode -------------------------------------------------------
    def _decode(self, block, x: torch.Tensor, stats: LayerStats) -> torch.Tensor:
        """One token x [1, H] through MoE layer l -> its routed output [1, H] (module docstring's steps)."""
        layer = block.layer
        residual = self.residual.pop(layer, None)  # r_l [1, 1, H]
        routing, ids = self._route(block, x, stats)  # route (ids already on the host when speculated)
        nxt = self.prefetcher.predict(layer, residual, routing, stats)  # predict l+1's routing, or None
        far = self.ahead.predict(layer, residual) if nxt is not None else None  # l+2's (ahead.py), or None
        routing, ids, nxt_ids = self._read_host(layer, routing, ids, nxt, stats, far)  # one host read (+ guard)
        far_best = nxt_ids[len(nxt_ids) - (far is not None) * len(ids):]  # l+2's ids best first, last
        nxt_ids = nxt_ids[: len(nxt_ids) - len(far_best)]
        half = len(nxt_ids) // 2  # l+1's ids in the routing's order, then best first (_read_host)
        nxt_ids, nxt_best = nxt_ids[:half], nxt_ids[half:]
        self.ahead.observe(layer, ids)
        self.observer.routing(layer, x, residual, routing)
        k_of = {e: k for k, e in enumerate(ids)}
        raws: list = [None] * len(ids)  # [1, H] per top-k position
        observer, tok = self.observer, self._decode_tok

        def put(e: int, raw: torch.Tensor) -> None:  # raw [1, H], from a slot or from the host
            observer.expert_output(layer, e, tok, raw)
            raws[k_of[e]] = raw

        queued = None
        if nxt is not None:  # prefetch l+1 behind l's demand copies
            prediction = Prediction(nxt, nxt_ids, nxt_best)
            def queued() -> None:  # l+1's prefetch, then l+2's ahead reads below it (ahead.py)
                self.prefetcher.prefetch(layer, prediction, self.recorder)
                if far_best:
                    self.ahead.issue(layer, far_best, self.recorder)
        # with nobody watching expert outputs, a batched layer hands back its one buffer in top-k order
        order = ids if type(observer).expert_output is Observer.expert_output else None
        stacked = self._stream(block, sorted(k_of), stats, lambda e: x, put, _one, queued,  # plan misses, stream
                               batch=self.policy.batch_experts, order=order)
        if stacked is not None:  # the same sum over the same [1, K, H] values (experts.sum_stacked)
            return sum_stacked(stacked, routing.weights, x)
        return sum_one_token(raws, routing.weights, x)  # combine: [1, K, H] * [1, K, 1] summed over K

    def _route(self, block, x: torch.Tensor, stats: LayerStats) -> tuple[Routing, list[int] | None]:
        """(true or speculated routing [1, K], its host ids when already known); counters stay on the device."""
        rec = self.recorder
        predicted = self.prefetcher.take(block.layer)
        speculate = predicted is not None and self.policy.execute == ExecuteMode.SPECULATIVE
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

    def _read_host(self, layer: int, routing: Routing, ids: list[int] | None, nxt: Routing | None,
                   stats: LayerStats, far: Routing | None = None) -> tuple[Routing, list[int], list[int]]:
        """The layer's one host read: what runs here and what l+1 is predicted to need, together
        (float64 in guarded mode, whose signals carry gate weights; int64 otherwise). Returns the
        routing that runs, its host ids and l+1's predicted host ids: [K] in the prediction's order,
        then the same [K] highest predicted weight first (the prefetch order), then (``far``: l+2's
        ahead prediction, ahead.py) l+2's [K] highest predicted weight first."""
        guarded = ids is None and self.policy.execute == ExecuteMode.GUARDED
        dtype = torch.float64 if guarded else routing.ids.dtype
        parts = []
        if ids is None:
            parts.append(guard_signals(routing) if guarded else routing.ids.reshape(-1))
        if nxt is not None:
            flat = nxt.ids.reshape(-1)  # [K] (decode: one token)
            best = flat[nxt.weights.reshape(-1).argsort(descending=True, stable=True)]  # [K]
            parts.append(torch.cat([flat, best]).to(dtype))
        if far is not None:
            parts.append(far.ids.reshape(-1)[far.weights.reshape(-1).argsort(descending=True, stable=True)].to(dtype))
        got = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist() if parts else []
        if ids is not None:
            return routing, ids, got
        k = routing.ids.shape[-1]
        if not guarded:
            return routing, got[:k], got[k:]
        n = signals_length(k, routing.logits.shape[-1])
        head, nxt_ids = got[:n], [int(v) for v in got[n:]]
        routing, ids = self._guard(layer, routing, head, [int(v) for v in head[:k]], stats)
        return routing, ids, nxt_ids

    def _guard(self, layer: int, true: Routing, signals: list[float], ids: list[int],
               stats: LayerStats) -> tuple[Routing, list[int]]:
        """Guarded mode: the routing that runs and its host ids, decided from the signals already read."""
        p = self.policy
        plan = plan_guard(signals, len(ids), self.cache.resident_experts(layer), p.fetch_threshold,
                          p.guard_rule, p.guard_substitute)
        stats.skipped += plan.skipped
        stats.skipped_mass += plan.skipped_mass
        stats.substituted += plan.substituted
        if plan.run is None:
            return true, ids
        return substituted_routing(true, plan.run), plan.run

    # --- prefill: always exact, experts grouped by one argsort -------------------------------
    def _prefill(self, block, x: torch.Tensor, stats: LayerStats) -> torch.Tensor:
        layer = block.layer
        self.prefetcher.take(layer)
        routing = self.adapter.route(block, x)
        self.observer.routing(layer, x, self.residual.get(layer), routing)
        groups = group_by_expert(routing.ids, self.adapter.num_experts())  # the layer's one host read
        acc = TopkSum(x, routing.weights)
        observer = self.observer

        def inputs(e: int) -> torch.Tensor:
            return x[groups.positions(e)[0]]  # [t, H]

        def put(e: int, raw: torch.Tensor) -> None:  # raw [t, H], from a slot or from the host
            tok, kpos, flat = groups.positions(e)  # [t] each
            observer.expert_output(layer, e, tok, raw)
            acc.put_pairs(flat, gated(raw, routing.weights[tok, kpos, None]))

        tokens = {e: end - start for e, (start, end) in groups.spans.items()}
        self._stream(block, groups.experts, stats, inputs, put, tokens.__getitem__, None)
        return acc.result()

    # --- plan misses, stream, collect ----------------------------------------------------------
    def _stream(self, block, experts: list[int], stats: LayerStats, inputs, put, tokens, queued,
                batch: bool = False, order: list[int] | None = None) -> torch.Tensor | None:
        """Compute ``experts`` (ascending ids) of ``block``'s layer: ``put(e, raw [t, H])`` for each.

        The ledger settles the layer's prefetch pins; misses the miss handler sends to the host start
        on the host pool first and are collected after the device's experts, so both compute at the
        same time; the device's experts run in the order their copies land (``queued()`` runs once the
        layer's demand copies are queued). ``batch`` (a decode step: every expert has the same
        tokens): when the device's experts are all resident and landed, they run in one call
        (:meth:`_batched`); else, and always for a prefill, one at a time (the reference).

        ``order`` (a decode step, ``experts`` in top-k order, nobody watching expert outputs): when the
        layer batches with no host job, its raw outputs come back as one tensor [K, 1, H] in that order
        and ``put`` is not called; otherwise (and always without ``order``) returns None.
        """
        layer, act, cache, rec, misses = block.layer, block.act_fn, self.cache, self.recorder, self.misses
        wasted = stats.prefetch_wasted
        kept = self.ledger.settle(layer, experts, stats)  # None: nothing was predicted for this layer
        jobs, device = misses.start(layer, experts, cache, tokens, inputs, act, stats)
        layout, engine = cache.store.layout.for_layer(layer), cache.engine  # GGUF layers may mix quant types
        timed = misses.times_device
        timing = rec.enabled or timed
        used = stats.prefetch_used
        slots = acquire_resident(cache, layer, device, stats, rec, kept, queued) if batch and device else None
        stacked = None
        if slots is not None:
            whole = order is not None and not jobs and len(order) == len(device)
            stacked = self._batched(device, slots, layout, inputs(device[0]), act, stats, put, timing,
                                    order if whole else None)
        for e, slot in stream(cache, layer, device, stats, rec, kept, queued) if slots is None else ():
            t0 = engine.mark() if timing else None
            put(e, layout.forward(inputs(e), cache.row(slot), act))  # [t, H] from the slot
            if timing:
                span = Span(t0, engine.mark())
                rec.span(stats, "compute_ms", span)
                if timed:
                    misses.observe_device(tokens(e), span)
        if kept is not None:  # a predicted layer: how many of its prefetches it used
            misses.observe_used(stats.prefetch_used - used)
            self.prefetcher.observed(layer, stats.prefetch_used - used, stats.prefetch_wasted - wasted)
        misses.collect(jobs, put, rec, stats)
        return stacked

    def _batched(self, experts: list[int], slots: list[int], layout, x: torch.Tensor, act, stats: LayerStats,
                 put, timing: bool, order: list[int] | None = None) -> torch.Tensor | None:
        """One decode layer's resident ``experts`` (pinned in ``slots``, acquire_resident) for x [1, H]
        in one call (ExpertLayout.forward_many), then ``put(e, raw [1, H])`` for each; releases the slots.
        With ``order`` (``experts`` again, in top-k order): the raw outputs as one tensor [K, 1, H] in
        that order (ExpertLayout.forward_stacked, the same values), no ``put``; forward_many where
        that call does not apply. Returns that tensor, or None when ``put`` got the outputs.

        Timed as one span; the miss planner (``times_device``) hears each expert as an equal share of it.
        """
        cache, engine, misses = self.cache, self.cache.engine, self.misses
        t0 = engine.mark() if timing else None
        stacked = raws = None
        try:
            if order is not None:
                at = dict(zip(experts, slots))
                stacked = layout.forward_stacked(x, cache.slots, [at[e] for e in order], act)  # [K, 1, H]
            if stacked is None:
                raws = layout.forward_many(x, cache.slots, slots, act)  # n x [1, H]
        finally:
            release_slots(cache, slots)
        if timing:
            t1 = engine.mark()
            self.recorder.span(stats, "compute_ms", Span(t0, t1))
            if misses.times_device and isinstance(t0, float):  # CPU marks (perf_counter s)
                step = (t1 - t0) / len(experts)
                for j in range(len(experts)):
                    misses.observe_device(1, Span(t0 + j * step, t0 + (j + 1) * step))
        if stacked is not None:
            return stacked
        for e, raw in zip(experts, raws):
            put(e, raw)
        return None


def _with_modes(fn):
    """``fn`` wrapped to run under the caller's inference / grad mode (both are thread-local)."""
    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    def run():
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return fn()

    return run


def _one(e: int) -> int:
    """A decode expert's token count."""
    return 1
