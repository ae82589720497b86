"""The arms of an evaluation (execution mode × predictor), and switching a loaded model between them.

``--execute exact,speculative,guarded --predictor router,hybrid`` makes exact (once: its outputs do
not depend on the predictor, which only prefetches) and every other mode with every predictor;
``--arms exact,speculative:router,guarded:hybrid`` names arms one by one. Exact is always run: it is
what every other arm is compared with, item by item.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moespec.config import ExecuteMode, Predictor


@dataclass(frozen=True)
class Arm:
    """One execution mode with one predictor (and τ for guarded)."""

    execute: ExecuteMode
    predictor: Predictor
    threshold: float | None = None

    @property
    def name(self) -> str:
        """File-safe name: ``exact``, ``speculative-router``, ``guarded-router-tau0.2``."""
        if self.execute == ExecuteMode.EXACT:
            return "exact"
        tail = f"-tau{self.threshold:g}" if self.execute == ExecuteMode.GUARDED else ""
        return f"{self.execute.value}-{self.predictor.value}{tail}"

    @property
    def label(self) -> str:
        """For tables: ``exact``, ``speculative router``, ``guarded router`` (τ goes in the title)."""
        return "exact" if self.execute == ExecuteMode.EXACT else f"{self.execute.value} {self.predictor.value}"


def make_arms(pairs: list[tuple[ExecuteMode, Predictor]], threshold: float) -> list[Arm]:
    """The arms to run: exact first (with the first pair's predictor when no exact pair is given),
    then every other (mode, predictor) pair in order, guarded ones at τ = ``threshold``; duplicates dropped.
    """
    exact = next((p for m, p in pairs if m == ExecuteMode.EXACT), pairs[0][1] if pairs else Predictor.ROUTER)
    made = [Arm(ExecuteMode.EXACT, exact)] + [
        Arm(m, p, threshold if m == ExecuteMode.GUARDED else None) for m, p in pairs if m != ExecuteMode.EXACT]
    return list({a.name: a for a in made}.values())


def cross(modes: list[ExecuteMode], predictors: list[Predictor]) -> list[tuple[ExecuteMode, Predictor]]:
    """``--execute`` × ``--predictor``: exact once (with the first predictor), every other mode with each."""
    return [(m, p) for m in modes for p in (predictors[:1] if m == ExecuteMode.EXACT else predictors)]


def use_arm(om, arm: Arm, predictor, gate: bool = True) -> None:
    """Run ``om`` as ``arm`` from now on, with ``predictor`` (built for ``arm.predictor``): the
    loaded policy with this arm's predictor, ``--execute`` mode and (guarded) τ swapped in, and the
    prediction gate as ``gated(arm, gate)`` says (``gate``: the loaded setting, RuntimeConfig.prediction_gate)."""
    om.reset_step()
    changes = {"predictor": predictor, "execute": arm.execute, "prediction_gate": gated(arm, gate)}
    if arm.threshold is not None:
        changes["fetch_threshold"] = arm.threshold
    om.use_policy(dataclasses.replace(om.policy, **changes))


def gated(arm: Arm, loaded: bool) -> bool:
    """Whether ``arm`` runs with the prediction gate (runtime/layer/gate.py) when the loaded policy says ``loaded``.

    Guarded runs without it: the gate opens and closes a layer's prediction from measured wall times
    (the predictor's ms, the copy worker's ms per copy), and in guarded mode what was predicted decides
    what is resident, so which misses are skipped, so the scores; without the gate every layer predicts
    on every decode step and a guarded score is the same on every run (tested). Exact and speculative keep
    the loaded setting: their outputs do not depend on it (speculative has no gate; exact fetches every
    miss), only their speed.
    """
    return False if arm.execute == ExecuteMode.GUARDED else loaded


def cold_start(om) -> None:
    """Before each item: no prefetch pins, an empty expert cache whose eviction rule starts from its seed,
    the token start's default vector unmeasured (runtime/layer/token_start.py), and the policy applied
    again, so the prediction gate (runtime/layer/gate.py) forgets what it measured (an item's score then
    does not depend on the items before it, so a resumed run equals a whole one)."""
    om.reset_step()
    om.cache.clear()
    om.runner.token_start.reset()
    om.use_policy(om.policy)
