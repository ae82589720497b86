"""Where a cache miss runs: fetched into a slot, or computed on the host (``--on-miss``).

Shapes: t tokens routed to one expert, H hidden, P packed elements per expert.

Costs (all ms, measured at load by a short benchmark, :func:`measure_costs`):
  copy_ms        one expert over the link (expert bytes / measured GB/s);
  host_ms(t)     one expert for t tokens on the host pool, a + b*t, kept as a running average
                 (every finished host job rescales it);
  device_ms(t)   one expert for t tokens on the device, a + b*t.

Plan of one layer (:meth:`MissPlanner.plan`, a greedy list schedule in the layer's miss order):
the device first computes the resident experts (and waits for in-flight prefetches), the link
already has ``queued`` copies ahead; each miss then goes where it would finish first:
  fetch: max(link free + copy_ms, device free) + device_ms(t)
  host:  earliest free host worker + host_ms(t)
and that resource's clock advances. ``host`` sends every miss to the host; ``fetch`` none. A
prefetch still in flight is a miss whose copy is already on the link (issued ``age`` ms ago, so it lands
in about copy_ms - age): it waits for it, or (auto) computes on the host when that finishes first (its
copy is not cancelled: it lands for later).
Decode (t = 1) on a slow link goes to the host; a prefill chunk (large t) where the device is
faster than the host plus the copy goes to the device. (FreeToken and Fiddler make the same
per-step choice from a measured link profile.)

Prefetch under ``auto``: a miss never waits on the link, so a prediction is worth copying if it
lands before its layer runs; :meth:`MissPlanner.prefetch_budget` admits as many copies as one
layer's running-average wall time carries, less the copies already queued (highest predicted
weight first), and at least one when the link is idle (a late copy costs no wait under ``auto``).
Without the limit, a slow link queues copies that every later step drains.

Whether to predict at all under ``auto`` (exact and guarded modes, where a prediction only feeds
prefetch): :meth:`MissPlanner.prefetch_pays`. A used prefetch saves at most one host job, host_ms(1)
(its expert runs on the device beside the pool instead of on the pool); predicting costs the
measured main-thread ms of the prediction and its prefetch bookkeeping. Both are running averages
(used prefetches per predicted layer, overhead ms per predicted layer); the layer predicts while
used x host_ms(1) >= overhead, else skips prediction and re-measures one layer in _PROBE_EVERY (64).
The numbers behind these rules: docs/decisions.md (2026-11-30 and 2026-12-01 entries on ``auto``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from moespec.config import OnMiss
from moespec.errors import OptionError
from moespec.runtime.misses.host_pool import HostExpertPool, HostResult, host_forward

_BENCH_TOKENS = (1, 16)
_AVERAGE = 0.2  # weight of a new observation in the running average of host ms
# One observation moves the running average by at most this factor ** _AVERAGE (x1.32): one preempted
# job must not send the next misses to the link (docs/decisions.md, 2026-11-30 "clamped geometric").
_STEP_CLAMP = 4.0
# While prediction does not pay, one decode layer in this many still predicts, so the measured
# overhead and usefulness follow a changed load or link.
_PROBE_EVERY = 64


@dataclass
class Costs:
    """Measured costs (ms) of one expert; ``host_scale`` is the running correction of host_ms.

    Attributes:
        copy_ms: one expert host->device.
        host_ms_1, host_ms_16: host compute for 1 and 16 tokens.
        device_ms_1, device_ms_16: device compute for 1 and 16 tokens.
        host_scale: running average of observed / predicted host ms (geometric, each step clamped).
        shared: host and device are the same processor (CPU): what slows the host (other load)
            slows the device alike, so device_ms follows host_scale too (else every slow host job
            would bias the choice toward fetching), until the device's own times are observed.
        device_scale: running average of observed / predicted device ms (shared processor only; None
            until a device expert was timed). The main thread's experts compete with the pool for
            the same cores, so the plan must see the device as it runs, not as benchmarked
            (docs/decisions.md, 2026-11-30 "shared processor").
    """

    copy_ms: float
    host_ms_1: float
    host_ms_16: float
    device_ms_1: float
    device_ms_16: float
    host_scale: float = 1.0
    shared: bool = False
    device_scale: float | None = None

    @staticmethod
    def _line(ms_1: float, ms_16: float, tokens: int) -> float:
        slope = max(ms_16 - ms_1, 0.0) / 15
        return max(ms_1 + slope * (tokens - 1), 0.0)

    def host_ms(self, tokens: int) -> float:
        """Predicted host ms for ``tokens`` tokens."""
        return self.host_scale * self._line(self.host_ms_1, self.host_ms_16, tokens)

    def device_ms(self, tokens: int) -> float:
        """Predicted device ms for ``tokens`` tokens."""
        scale = 1.0
        if self.shared:
            scale = self.host_scale if self.device_scale is None else self.device_scale
        return scale * self._line(self.device_ms_1, self.device_ms_16, tokens)

    def observe_host(self, tokens: int, ms: float) -> None:
        """Fold one finished host job into the running average.

        An exponential average of log(observed / predicted), each observation first clamped to
        [1/4, 4] x the current average: robust to single outliers (preemption), still follows a host
        that is really slower (x10 takes 9 jobs, less than one decode token of the default model).
        """
        self.host_scale = _folded(self.host_scale, ms, self._line(self.host_ms_1, self.host_ms_16, tokens))

    def observe_device(self, tokens: int, ms: float) -> None:
        """Shared processor: fold one expert computed on the device (main thread, synchronous on CPU)
        into device_scale, as observe_host does for the pool (clamped steps)."""
        cur = self.host_scale if self.device_scale is None else self.device_scale
        self.device_scale = _folded(cur, ms, self._line(self.device_ms_1, self.device_ms_16, tokens))


def _folded(scale: float, ms: float, want: float) -> float:
    """``scale`` (observed / predicted ms, geometric running average) after one observation of ``ms``
    against a prediction of ``want`` ms at scale 1, the step clamped to [1/_STEP_CLAMP, _STEP_CLAMP]."""
    if want <= 0 or ms <= 0:
        return scale
    step = min(max(ms / want / scale, 1 / _STEP_CLAMP), _STEP_CLAMP)
    return scale * step**_AVERAGE


def _median_ms(fn, reps: int = 3) -> float:
    fn()  # warm-up (allocations, kernel choice)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure_costs(store, engine, device: torch.device, dtype: torch.dtype, act, what: str,
                  pool: HostExpertPool | None = None) -> Costs:
    """Benchmark one expert: the link copy, host and device compute for 1 and 16 tokens.

    Args:
        store: the ExpertStore; engine: the transfer engine; device, dtype: compute device and dtype.
        act: an MoE block's activation (None where the layout has its own).
        what: the model and dtype in words, for the error message.
        pool: the host pool; its host times are taken on one of its workers (one intra-op thread,
            the CPU kernels, as its jobs run), else on the calling thread.

    Raises:
        OptionError: the host cannot compute these experts (names --on-miss).
    """
    layer = store.moe_layers[0]
    layout = store.layout.for_layer(layer)
    row = store.expert(layer, 0)  # [P] host row, read in place
    hidden = layout.hidden

    def host_times() -> dict[int, float]:
        with torch.inference_mode():
            return {t: _median_ms(lambda t=t: host_forward(layout, torch.zeros(t, hidden, dtype=dtype), row, act))
                    for t in _BENCH_TOKENS}

    try:
        host = host_times() if pool is None else pool.run_on_worker(host_times)
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        raise OptionError(f"--on-miss cannot compute {what} experts on the host: {str(exc).splitlines()[0]}",
                          "use --on-miss fetch") from None
    scratch = torch.empty(row.shape, dtype=row.dtype, device=device)  # [P]

    def copy() -> None:
        engine.wait(engine.submit(scratch, row, -1))
        engine.synchronize()

    copy_ms = _median_ms(copy)

    def on_device(t: int) -> None:
        layout.forward(torch.zeros(t, hidden, dtype=dtype, device=device), scratch, act)
        if device.type != "cpu":
            # Why: device time, not launch time. On CPU the forward is synchronous, and the engine's
            # synchronize is a copy-thread round trip that doubled device_ms (docs/decisions.md).
            engine.synchronize()

    dev = {t: _median_ms(lambda t=t: on_device(t)) for t in _BENCH_TOKENS}
    return Costs(copy_ms=copy_ms, host_ms_1=host[1], host_ms_16=host[16], device_ms_1=dev[1], device_ms_16=dev[16],
                 shared=device.type == "cpu")


@dataclass(frozen=True)
class MissPlan:
    """Which experts of one layer run on the host, and the plan's predicted finish times (ms)."""

    host: frozenset[int]
    device_ms: float
    host_ms: float


class MissPlanner:
    """The per-layer fetch-or-host choice for one loaded model, with its host pool.

    Args:
        costs: measured costs (updated as host jobs finish).
        pool: the host worker pool.
    """

    def __init__(self, costs: Costs, pool: HostExpertPool) -> None:
        self.costs = costs
        self.pool = pool
        self.layer_ms: float | None = None  # running average of one MoE layer's wall time (decode)
        self._last: float | None = None
        # Running averages for prefetch_pays: main-thread ms of one layer's prediction + prefetch
        # bookkeeping, and prefetched experts used by a predicted layer (None: not measured yet).
        self.predict_ms: float | None = None
        self.used_per_layer: float | None = None
        self._since_probe = 0

    def layer_started(self, new_step: bool = False) -> None:
        """Mark the start of an MoE layer (``new_step``: a new forward; the gap before it is not a layer)."""
        now = time.perf_counter()
        if not new_step and self._last is not None:
            ms = (now - self._last) * 1e3
            self.layer_ms = ms if self.layer_ms is None else self.layer_ms + _AVERAGE * (ms - self.layer_ms)
        self._last = None if new_step else now

    def prefetch_budget(self, in_flight: int) -> int:
        """Auto mode: how many of the next layer's predictions to copy now.

        As many as land within one layer's running-average wall time, less the copies already on the
        link (unknown layer time, first layer: one); and, when the link is idle, at least the best
        prediction even if its copy outlasts a layer. Why: under ``auto`` a late copy costs no wait
        (its miss is computed on the host, the copy lands for later), so the expected saving of an
        idle-link copy, P(used) x the host ms it may avoid, is never negative, while a busy link
        would push later copies behind it.
        """
        idle = 1 if in_flight == 0 else 0
        if self.layer_ms is None:
            return max(1 - in_flight, 0)
        return max(int(self.layer_ms / max(self.costs.copy_ms, 1e-6)) - in_flight, idle)

    def prefetch_pays(self) -> bool:
        """Auto mode: whether this decode layer should predict the next one (and prefetch it).

        True until both running averages exist, while ``used_per_layer x host_ms(1) >= predict_ms``
        (the host ms the used prefetches may take off the pool, against the main thread's cost of
        predicting), and for one layer in ``_PROBE_EVERY`` otherwise (a probe that refreshes them).
        """
        if self.predict_ms is None or self.used_per_layer is None:
            return True
        if self.used_per_layer * self.costs.host_ms(1) >= self.predict_ms:
            self._since_probe = 0
            return True
        self._since_probe += 1
        if self._since_probe >= _PROBE_EVERY:
            self._since_probe = 0
            return True
        return False

    def observe_predict(self, ms: float) -> None:
        """Fold the main-thread ms of one layer's prediction and prefetch issue into its average
        (each observation clamped to ``_STEP_CLAMP`` x the average: one preempted layer is not the cost)."""
        avg = self.predict_ms
        self.predict_ms = ms if avg is None else avg + _AVERAGE * (min(ms, _STEP_CLAMP * avg) - avg)

    def observe_used(self, used: int) -> None:
        """Fold the prefetched experts a predicted layer used (computed on the device) into its average."""
        u = self.used_per_layer
        self.used_per_layer = float(used) if u is None else u + _AVERAGE * (used - u)

    def plan(self, mode: OnMiss, resident: list[tuple[int, int]], in_flight: list[tuple[int, int]],
             misses: list[tuple[int, int]], queued: int, ages_ms: dict[int, float] | None = None) -> MissPlan:
        """Decide where the misses of one layer run.

        Args:
            mode: FETCH (none on the host), HOST (every miss; in-flight prefetches still run on the
                device), AUTO (per miss and per in-flight prefetch, see the module docstring).
            resident: (expert, t) resident and landed: computed on the device; where the device is the
                host's own processor (``costs.shared``, AUTO), the last ones move to the pool while that
                shortens the layer (the main thread and the pool share the cores; no copy either way).
            in_flight: (expert, t) resident but whose copy may not have landed (a prefetch).
            misses: (expert, t) not resident, in the order they would be fetched.
            queued: copies already on the link ahead of this layer's misses.
            ages_ms: expert -> ms since its in-flight copy was issued; its copy lands in about
                copy_ms - age behind the older in-flight copies (missing: just issued).

        Returns:
            MissPlan; ``host`` holds a resident expert only on a shared processor.
        """
        if mode == OnMiss.FETCH:
            return MissPlan(frozenset(), 0.0, 0.0)
        if mode == OnMiss.HOST:
            return MissPlan(frozenset(e for e, _ in misses), 0.0, 0.0)
        c = self.costs
        costs: dict[int, tuple[float, float]] = {}  # t -> (device ms, host ms): one evaluation per t

        def cost(t: int) -> tuple[float, float]:
            got = costs.get(t)
            if got is None:
                got = costs[t] = (c.device_ms(t), c.host_ms(t))
            return got

        dev = 0.0
        for _, t in resident:
            dev += cost(t)[0]
        workers = [0.0] * self.pool.threads
        host: set[int] = set()
        ages = ages_ms or {}
        # In-flight prefetches, oldest first: the link finishes each copy_ms after the later of the
        # previous one's end and its own issue (-age ms from now). Then the misses, whose demand
        # copies go before queued prefetches (CPU engine; CUDA: their own stream).
        landed_at = float("-inf")  # ms from now; negative: landed already
        link = queued * c.copy_ms
        order = [(e, t, True) for e, t in sorted(in_flight, key=lambda et: -ages.get(et[0], 0.0))]
        for e, t, prefetched in order + [(e, t, False) for e, t in misses]:
            dev_ms, host_ms = cost(t)
            if prefetched:
                landed_at = max(landed_at, -ages.get(e, 0.0)) + c.copy_ms
                fetch_done = max(landed_at, dev) + dev_ms
            else:
                fetch_done = max(link + c.copy_ms, dev) + dev_ms
            w = 0 if len(workers) == 1 else min(range(len(workers)), key=workers.__getitem__)
            host_done = workers[w] + host_ms
            if host_done < fetch_done:
                host.add(e)
                workers[w] = host_done
            else:
                if not prefetched:
                    link += c.copy_ms
                dev = fetch_done
        if c.shared:
            # Same cores: a landed expert needs no copy, so it may as well run on the pool. Move them
            # (last first) while that shortens the layer, max(device, host), by the observed costs.
            for e, t in reversed(resident):
                dev_ms, host_ms = cost(t)
                w = min(range(len(workers)), key=workers.__getitem__)
                if max(dev - dev_ms, workers[w] + host_ms) >= max(dev, max(workers)):
                    break
                host.add(e)
                workers[w] += host_ms
                dev -= dev_ms
        return MissPlan(frozenset(host), dev, max(workers))

    def observe(self, result: HostResult) -> None:
        """Update the running average of host ms from a finished job."""
        self.costs.observe_host(result.tokens, result.host_ms)

    def close(self) -> None:
        """Stop the host pool."""
        self.pool.close()
