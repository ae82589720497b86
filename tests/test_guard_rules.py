"""Guarded mode's rules on a scripted routing: which experts are skipped, what substitutes them,
how many bytes are fetched; and on a tiny model, that the accounting and the budget bound hold."""

from __future__ import annotations

import pytest
import torch

from moespec.config import ExecuteMode, GuardRule, Predictor, RuntimeConfig, SamplingConfig
from moespec.models.base import Routing
from moespec.runtime.layer.guard import guard_routing, guard_signals, plan_guard

EXPERT_BYTES = 1000
# K = 4 true experts 2, 5, 7, 1 with renormalised weights 0.4, 0.3, 0.2, 0.1 (E = 8).
IDS = [2, 5, 7, 1]
W = [0.4, 0.3, 0.2, 0.1]
# Router logits: among the residents outside the top-K, 3 scores best, then 6, then 0.
LOGITS = torch.tensor([[0.5, 1.5, 3.0, 2.5, -1.0, 2.8, 1.0, 2.0]])
RESIDENT = {2, 0, 3, 6}  # misses: 5 (0.3), 7 (0.2), 1 (0.1)


def _routing() -> Routing:
    return Routing(ids=torch.tensor([IDS]), weights=torch.tensor([W]), logits=LOGITS)


def _plan(tau, rule, substitute=True):
    return plan_guard(guard_signals(_routing()).tolist(), 4, RESIDENT, tau, rule, substitute)


def _fetched_bytes(run) -> int:
    """Bytes the layer copies: every expert that runs and is not resident."""
    return sum(EXPERT_BYTES for e in (IDS if run is None else run) if e not in RESIDENT)


@pytest.mark.parametrize("tau,rule,run,skipped,mass,subs", [
    # threshold: every miss lighter than τ goes (7 and 1); 5 (0.3) is fetched; best residents 3, 6 stand in
    (0.25, GuardRule.THRESHOLD, [2, 5, 3, 6], 2, 0.3, 2),
    # budget: lightest first while the skipped sum stays <= τ: 1 (0.1), then 7 would make 0.3 > 0.25
    (0.25, GuardRule.BUDGET, [2, 5, 7, 3], 1, 0.1, 1),
    (0.35, GuardRule.BUDGET, [2, 5, 3, 6], 2, 0.3, 2),
    (0.65, GuardRule.BUDGET, [2, 3, 6, 0], 3, 0.6, 3),  # every miss: 0.6 <= 0.65
    (0.05, GuardRule.THRESHOLD, None, 0, 0.0, 0),  # no miss is lighter than 0.05
])
def test_scripted_skips_substitutes_and_bytes(tau, rule, run, skipped, mass, subs):
    plan = _plan(tau, rule)
    assert plan.run == run
    assert (plan.skipped, plan.substituted) == (skipped, subs)
    assert plan.skipped_mass == pytest.approx(mass, abs=1e-6)
    exact_bytes = 3 * EXPERT_BYTES  # exact fetches the three misses
    assert _fetched_bytes(plan.run) == exact_bytes - skipped * EXPERT_BYTES
    ref = guard_routing(_routing(), RESIDENT, tau, rule)
    assert ref.routing.ids.tolist()[0] == (IDS if run is None else run)


def test_without_substitution_the_skipped_expert_is_dropped_and_mass_kept():
    plan = _plan(0.25, GuardRule.THRESHOLD, substitute=False)
    assert plan.run == [2, 5] and plan.substituted == 0 and plan.skipped == 2
    ref = guard_routing(_routing(), RESIDENT, 0.25, GuardRule.THRESHOLD, substitute=False)
    assert ref.routing.ids.tolist() == [[2, 5]]
    w = ref.routing.weights[0]
    assert float(w.sum()) == pytest.approx(1.0, abs=1e-6)  # the true top-K mass
    p = torch.softmax(LOGITS[0], -1)
    assert float(w[0] / w[1]) == pytest.approx(float(p[2] / p[5]), rel=1e-5)  # router softmax over what runs


@pytest.mark.parametrize("rule", list(GuardRule))
def test_tau_zero_is_exact(rule):
    assert _plan(0.0, rule).run is None
    assert guard_routing(_routing(), RESIDENT, 0.0, rule).routing.ids.tolist() == [IDS]


@pytest.mark.parametrize("rule", list(GuardRule))
def test_guarded_run_accounts_bytes_and_bounds_mass(tiny_models, rule):
    """On a tiny model: bytes = fetched misses × expert bytes; the budget rule never skips more than τ
    of a token's mass at a layer (threshold: each skipped expert is lighter than τ)."""
    from moespec.runtime.engine import Engine
    from moespec.runtime.load import load_offloaded
    from moespec.runtime.stats import StatsRecorder

    tau = 0.3
    cfg = RuntimeConfig(device="cpu", cache_experts=4, predictor=Predictor.NONE, execute=ExecuteMode.GUARDED,
                        fetch_threshold=tau, guard_rule=rule)
    om = load_offloaded(tiny_models["qwen3_moe"], cfg, StatsRecorder())
    try:
        list(Engine(om).generate([3, 14, 15, 92, 65, 35], SamplingConfig(max_new_tokens=12)))
        decode = [s for s in om.recorder.steps if s.kind == "decode"]
        skipped = 0
        for step in decode:
            for st in step.layers.values():
                assert st.h2d_bytes == st.misses * om.store.expert_bytes
                assert st.skipped_mass <= (tau + 1e-6 if rule == GuardRule.BUDGET else st.skipped * tau + 1e-6)
                skipped += st.skipped
        assert skipped > 0  # the guard really skipped something
    finally:
        om.close()
