"""What the layer runner asks about its misses, one class per ``--on-miss`` mode (no branches there).

Shapes: t tokens routed to one expert, H hidden.

Per layer the runner asks its handler to start the misses that run on the host (``start``: the
host jobs and the experts left to the device), to collect them after the device's experts
(``collect``), how to order and bound a prefetch (``prefetch_plan``), and, as the prediction gate,
whether predicting pays (``pays``, ``observe_predict``, ``observe_used``; ``--on-miss auto`` in
exact and guarded modes only). :class:`FetchMisses` is the no-op twin of the other two: every
miss is copied, nothing is measured.

- ``fetch`` (:class:`FetchMisses`): no host job; a prediction is prefetched highest weight first, unbounded.
- ``host`` (:class:`HostMisses`): every miss goes to the host pool; in-flight prefetches run on the
  device.
- ``auto`` (:class:`AutoMisses`): the planner's per-miss choice from measured costs, a prefetch
  budget of what lands within a layer (highest predicted weight first), and the prediction gate.

Once a host pool exists (a policy with host or auto ran), every handler keeps the planner's layer
clock going, so its running layer time stays the average over every decode layer.
"""

from __future__ import annotations

from typing import Callable

from moespec.config import OnMiss
from moespec.runtime.cache.slots import ExpertCache
from moespec.runtime.misses.host_pool import HostJob
from moespec.runtime.misses.planner import MissPlanner
from moespec.runtime.stats import LayerStats, StatsRecorder
from moespec.runtime.transfer.base import Span


def _ignore(*args) -> None:
    pass


def _always() -> bool:
    return True


class FetchMisses:
    """``--on-miss fetch``: every miss is copied into a slot; the prediction gate is always open.

    Args:
        planner: the host pool's planner when one exists (its layer clock keeps running), else None.
    """

    times_device = False  # no device expert is timed for a planner

    def __init__(self, planner: MissPlanner | None = None) -> None:
        self.layer_started: Callable[[bool], None] = planner.layer_started if planner is not None else _ignore

    def start(self, layer: int, experts: list[int], cache: ExpertCache, tokens, inputs, act,
              stats: LayerStats) -> tuple[dict[int, HostJob], list[int]]:
        """(host jobs by expert, the experts left to the device, in order): here none, all."""
        return {}, experts

    def collect(self, jobs: dict[int, HostJob], put, recorder: StatsRecorder, stats: LayerStats) -> None:
        """Wait for the host jobs (ascending ids) and hand each raw output [t, H] to ``put(e, raw)``."""

    def prefetch_plan(self, ids: list[int], cache: ExpertCache) -> tuple[list[int], int | None]:
        """(the predicted experts in prefetch order, most copies or None): here the given order (highest
        predicted weight first: the likeliest rows land first), no limit."""
        return list(dict.fromkeys(ids)), None

    def observe_device(self, tokens: int, span: Span) -> None:
        """A device expert for ``tokens`` tokens took ``span`` (only called when ``times_device``)."""

    def pays(self) -> bool:
        """Whether this decode layer should predict the next one."""
        return True

    def observe_predict(self, ms: float) -> None:
        """The main-thread ms of one layer's prediction and prefetch issue."""

    def observe_used(self, used: int) -> None:
        """Prefetched experts a predicted layer used."""


class HostMisses(FetchMisses):
    """``--on-miss host``: every miss is computed on the host pool from its store row.

    Args:
        planner: the planner, with the host pool.
    """

    mode = OnMiss.HOST

    def __init__(self, planner: MissPlanner) -> None:
        super().__init__(planner)
        self.planner = planner

    def _where(self, layer: int, experts: list[int], resident: set[int], cache: ExpertCache, tokens):
        """(landed, in_flight, queued, ages) for the planner: nothing here (every miss goes to the host)."""
        return [], [], 0, {}

    def start(self, layer: int, experts: list[int], cache: ExpertCache, tokens, inputs, act,
              stats: LayerStats) -> tuple[dict[int, HostJob], list[int]]:
        resident = cache.resident_experts(layer)
        misses = [(e, tokens(e)) for e in experts if e not in resident]
        landed, in_flight, queued, ages = self._where(layer, experts, resident, cache, tokens)
        plan = self.planner.plan(self.mode, landed, in_flight, misses, max(queued, 0), ages)
        chosen = [e for e in experts if e in plan.host]
        if not chosen:
            return {}, experts
        jobs = {}
        for job in self.planner.pool.submit_layer(layer, [(e, inputs(e)) for e in chosen], act):
            stats.host_computed += 1
            stats.d2h_bytes += job.d2h_bytes
            stats.host_h2d_bytes += job.h2d_bytes
            jobs[job.expert] = job
        return jobs, [e for e in experts if e not in jobs]

    def collect(self, jobs: dict[int, HostJob], put, recorder: StatsRecorder, stats: LayerStats) -> None:
        for e, job in jobs.items():  # ascending ids; the sum's order is fixed by put's positions
            done = job.result()
            recorder.span(stats, "host_ms", Span(done.start, done.end))
            self.planner.observe(done)
            put(e, done.raw)


class AutoMisses(HostMisses):
    """``--on-miss auto``: per miss, whatever the measured costs say finishes first (planner.py).

    Args:
        planner: the planner, with the host pool.
        gate: the prediction gate is on (exact and guarded modes; a speculative layer runs its
            prediction, so it always predicts).
    """

    mode = OnMiss.AUTO

    def __init__(self, planner: MissPlanner, gate: bool) -> None:
        super().__init__(planner)
        # Synchronous on a shared (CPU) device: the main thread's real cost per expert.
        self.times_device = planner.costs.shared
        if not gate:  # the fetch twin's: always predict, nothing to measure
            self.pays, self.observe_predict, self.observe_used = _always, _ignore, _ignore

    def pays(self) -> bool:
        return self.planner.prefetch_pays()

    def observe_predict(self, ms: float) -> None:
        self.planner.observe_predict(ms)

    def observe_used(self, used: int) -> None:
        self.planner.observe_used(used)

    def _where(self, layer: int, experts: list[int], resident: set[int], cache: ExpertCache, tokens):
        landed, in_flight = [], []  # landed: may go to the host on a shared processor
        for e in experts:
            if e in resident:
                (landed if cache.landed((layer, e)) else in_flight).append((e, tokens(e)))
        ages = {e: cache.copy_age_ms((layer, e)) for e, _ in in_flight}
        return landed, in_flight, cache.copies_in_flight() - len(in_flight), ages

    def prefetch_plan(self, ids: list[int], cache: ExpertCache) -> tuple[list[int], int | None]:
        # A miss never waits on the link, so copy only what the budget admits (highest-weight
        # predictions first); the rest is computed on the host there. Resident ones cost no copy.
        return list(dict.fromkeys(ids)), self.planner.prefetch_budget(cache.copies_in_flight())

    def observe_device(self, tokens: int, span: Span) -> None:
        self.planner.costs.observe_device(tokens, span.ms())


def miss_handler(on_miss: OnMiss, planner: MissPlanner | None, gate: bool) -> FetchMisses:
    """The handler of ``on_miss`` (``planner``: required but for fetch; ``gate``: see AutoMisses)."""
    if on_miss == OnMiss.FETCH:
        return FetchMisses(planner)
    if on_miss == OnMiss.HOST:
        return HostMisses(planner)
    return AutoMisses(planner, gate)

