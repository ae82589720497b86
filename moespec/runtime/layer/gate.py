"""PredictionGate: per MoE layer, predict the next layer only while prefetching it saves more than it costs.

A decode layer l that predicts l+1 pays, on the main thread, the predictor's time and the
prefetch bookkeeping (``predict_ms``, measured), and on the link one copy per wrong prediction
plus, at most, one would-be hit its slot displaced (slots.py: a wrong copy takes the slot the rule
gave up, and is the next reused). What it saves: each used prefetch copy is a demand miss whose
copy ran behind l's compute instead of in front of l+1's (at most one copy's time). With ``c``
the link's measured ms per expert copy (the transfer engine's busy time per copy):

    saving = used x c        cost = predict_ms + wasted x 2c        (running averages per layer)

Layer l predicts while saving >= cost (decided after ``MIN_OUTCOMES`` predicted visits, whose
fastest prediction seeds predict_ms; later ones are clamped to 4x it: a first call or a preempted
layer is not the cost); else it skips and re-measures with one probe in
every ``PROBE_EVERY`` of its decode visits, so a layer whose routing becomes predictable comes back.
With every expert resident nothing is copied (saving 0), so a prediction that costs anything
stops after the first measurements. Until a layer has a measurement it predicts. Speculative
mode has no gate (a speculated layer runs its prediction); ``--on-miss auto`` has its own
instead (misses/planner.py: a used prefetch saves a host job there).

The decision and its numbers per layer: :meth:`PredictionGate.report` (``moespec profile``).
"""

from __future__ import annotations

from dataclasses import dataclass

PROBE_EVERY = 64  # decode visits of a closed layer between probes
MIN_OUTCOMES = 4  # outcomes a layer is measured on before the gate may close it
_AVERAGE = 0.1  # weight of a new observation in the running averages
_STEP_CLAMP = 4.0  # one predict_ms observation counts at most this many times the average (a preempted
#                    layer, a first call, is not the cost)


@dataclass
class LayerGate:
    """One layer's running averages (None: not measured yet) and decision.

    Attributes:
        used, wasted: prefetch copies per predicted visit that the next layer used / never used.
        predict_ms: main-thread ms of one prediction and its prefetch issue.
        open: whether the layer predicts now; outcomes: predicted visits measured; since_probe: closed
            visits since the last probe.
        ran, skipped: decode visits that predicted / that the gate skipped.
    """

    used: float | None = None
    wasted: float | None = None
    predict_ms: float | None = None
    open: bool = True
    outcomes: int = 0
    since_probe: int = 0
    ran: int = 0
    skipped: int = 0


def _fold(avg: float | None, x: float) -> float:
    return x if avg is None else avg + _AVERAGE * (x - avg)


class PredictionGate:
    """The per-layer gate of exact and guarded modes (module docstring).

    Args:
        copy_ms: callable returning the link's ms per expert copy (None: not known yet).
    """

    def __init__(self, copy_ms) -> None:
        self.copy_ms = copy_ms
        self.layers: dict[int, LayerGate] = {}

    def admits(self, layer: int) -> bool:
        """Whether decode layer ``layer`` predicts the next one now (counts ran / skipped)."""
        g = self.layers.setdefault(layer, LayerGate())
        if not g.open:
            g.since_probe += 1
            if g.since_probe < PROBE_EVERY:
                g.skipped += 1
                return False
            g.since_probe = 0  # a probe: predict once, re-measure, decide again
        g.ran += 1
        return True

    def observe_predict(self, layer: int, ms: float) -> None:
        """``layer``'s prediction and prefetch issue took ``ms`` on the main thread."""
        g = self.layers.setdefault(layer, LayerGate())
        if g.predict_ms is None or g.outcomes < MIN_OUTCOMES:  # the fastest of the first: one-time costs out
            g.predict_ms = ms if g.predict_ms is None else min(g.predict_ms, ms)
        else:
            g.predict_ms = _fold(g.predict_ms, min(ms, _STEP_CLAMP * g.predict_ms))

    def observe_outcome(self, layer: int, used: int, wasted: int) -> None:
        """The layer ``layer`` predicted has run: ``used`` of its prefetch copies were used, ``wasted``
        were not; the gate decides again."""
        g = self.layers.setdefault(layer, LayerGate())
        g.used = _fold(g.used, used)
        g.wasted = _fold(g.wasted, wasted)
        g.outcomes += 1
        saving, cost = self.saving_cost(layer)
        g.open = g.outcomes < MIN_OUTCOMES or saving is None or saving >= cost

    def saving_cost(self, layer: int) -> tuple[float | None, float]:
        """(saving ms, cost ms) per predicted visit of ``layer``; saving None while not measured."""
        g = self.layers.get(layer)
        if g is None or g.predict_ms is None or g.used is None:
            return None, 0.0
        c = self.copy_ms()
        if c is None:  # the link's speed is not measured: anything used may pay, nothing used cannot
            return (None, 0.0) if g.used > 0 else (0.0, g.predict_ms)
        return g.used * c, g.predict_ms + g.wasted * 2.0 * c

    def report(self) -> dict[int, dict]:
        """Per layer: open, ran, skipped, saving_ms, cost_ms and why (one line)."""
        out = {}
        for layer, g in sorted(self.layers.items()):
            saving, cost = self.saving_cost(layer)
            if saving is None:
                why = "not measured yet" if g.used is None else "link speed unknown, copies used"
            else:
                why = f"saves {saving:.2f} ms {'>=' if g.open else '<'} costs {cost:.2f} ms"
            out[layer] = {"open": g.open, "ran": g.ran, "skipped": g.skipped, "saving_ms": saving,
                          "cost_ms": cost, "why": why}
        return out


def link_ms_per_copy(cache):
    """The gate's ``copy_ms`` for ``cache``: the transfer engine's busy ms per copy issued so far
    (None while nothing was copied, or when the engine does not time its copies)."""

    def ms() -> float | None:
        busy, n = cache.engine.busy_seconds(), cache.copies
        return busy * 1e3 / n if busy > 0 and n > 0 else None

    return ms
