"""Eviction rules of the expert cache (``--cache-policy lru|lfu|lfru|static``).

Shapes: M MoE layers, E experts per layer, K top-k.

A rule only picks the victim among the cache's evictable slots (unpinned) and learns from each
use; the cache (slots.py) owns slots, pins and copies. Scores are in "expected uses per
token at the key's layer", so keys of different layers compare.

- ``lru``: the least recently released slot.
- ``lfu``: the fewest uses; counts seeded with the calibration file's frequencies (per-token use
  probability x ``SEED_TOKENS`` pseudo-tokens) and incremented on every use; ties go to LRU order.
- ``lfru``: frequency with recency decay: a key's count decays by ``LFRU_DECAY`` per visit of its
  layer (1/M of it per visit of any of the M layers, so all keys decay alike) and gains 1 per use;
  seeded with p / (1 - decay), its stationary value. Ties go to LRU order.
- ``static``: a hot set of the ``hot_slots`` most frequent (layer, expert) keys of the calibration
  file (the frequency placement of KTransformers' GPU experts) is never evicted once loaded;
  everything else is LRU. ``hot_slots`` = slots - 2K, so the running layer and one layer's
  prefetch always have room.

Empty slots are always taken first. Source of the frequency rules: O'Neil et al., "The LRU-K page
replacement algorithm" (1993) and Lee et al., "LRFU" (2001), which the decayed count follows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import torch

from moespec.artifacts import find_calibration, model_key
from moespec.config import DEFAULT_CACHE_POLICY, CachePolicy
from moespec.errors import CalibrationError
from moespec.predict.calibration_file import load_calibration, load_checked
from moespec.runtime.cache.slot import Key, Slot

NEXT_TOKEN = 0  # the ``distance`` of a ranking made before a token's first layer, about that token's layers
SEED_TOKENS = 64.0  # pseudo-tokens of calibration evidence behind an lfu count
LFRU_DECAY = 0.97  # per visit of the layer: a use 23 tokens ago weighs half (tuned: docs/decisions.md)


class EvictionRule:
    """LRU: the victim is the first of ``order`` (slots in release order, oldest and empties first)."""

    policy = CachePolicy.LRU
    # The last layer's experts are evicted only when nothing else can go: a prefetch for the next
    # layer picks its slot while they are pinned, so its demand miss must pick the same (slots.py).
    keeps_last_visit = True

    def used(self, key: Key) -> None:
        """``key`` was acquired for compute (a hit or a miss)."""

    def visit(self, layer: int) -> None:
        """A visit of ``layer`` begins (the stream calls it before the layer's first acquire)."""

    def victim(self, order: Iterable[Slot]) -> Slot | None:
        """The slot to evict among ``order`` (evictable slots, oldest first); None when empty."""
        return next(iter(order), None)

    # Rankings of a layer's experts, for a rule that looks ahead (foresight.py); the others ignore them.
    def routed(self, layer: int, ranked: list[int]) -> None:
        """``layer``'s router logits of this decode token, as expert ids best first (buffered)."""

    def predicted(self, layer: int, ranked: list[int], distance: int = 1) -> None:
        """The predictor's logits for ``layer``'s coming visit, as expert ids best first (buffered);
        ``distance``: MoE layers from the running one to ``layer`` (2: a lookahead prediction;
        NEXT_TOKEN: made before the token's first layer, from the last token's state)."""

    def commit(self) -> None:
        """Apply the buffered rankings (the stream calls it once the running layer's demand copies
        are queued, before the next layer's prefetch: a score never moves between the two)."""


class LfuRule(EvictionRule):
    """Least frequently used, seeded from calibration use probabilities ``seed`` (key -> uses/token)."""

    policy = CachePolicy.LFU

    def __init__(self, seed: dict[Key, float]) -> None:
        self.count = {k: p * SEED_TOKENS for k, p in seed.items()}

    def used(self, key: Key) -> None:
        self.count[key] = self.count.get(key, 0.0) + 1.0

    def score(self, key: Key) -> float:
        """Retention value of ``key`` (higher is kept; compared among keys, never against a constant)."""
        return self.count.get(key, 0.0)

    def victim(self, order: Iterable[Slot]) -> Slot | None:
        best, best_score = None, float("inf")
        for slot in order:  # oldest first: a strict < keeps the LRU slot among equal scores
            key = slot.key
            if key is None:
                return slot
            s = self.score(key)
            if s < best_score:
                best, best_score = slot, s
        return best


class LfruRule(LfuRule):
    """Frequency decayed by recency: count x LFRU_DECAY^(visits of the layer since the last use) + 1 per use.

    The clock counts layer visits of every layer (``visit``), M of them per decode token, and a
    count decays by LFRU_DECAY^(1/M) per visit: so by LFRU_DECAY per visit of its own layer, as
    every key decays alike. The retention value is kept as a log relative to visit 0, so comparing
    two keys does not depend on when they are compared (a prefetch picks, ahead of its layer, the
    victim its demand miss would pick: slots.py) nor on the order of one visit's uses.

    Args:
        seed: key -> use probability per token; counts start at p / (1 - decay).
        top_k: K (kept for make_rule's signature).
        layers: M, the MoE layers (None: the layers of ``seed``, at least 1).
        decay: per visit of the key's layer, in (0, 1); LFRU_DECAY unless a test or a sweep asks.
    """

    policy = CachePolicy.LFRU

    def __init__(self, seed: dict[Key, float], top_k: int, layers: int | None = None,
                 decay: float = LFRU_DECAY) -> None:
        self.top_k = top_k
        m = layers if layers is not None else len({key[0] for key in seed})
        self.step = math.log(decay) / max(m, 1)  # log-decay per visit (< 0)
        self.clock = 0  # layer visits so far
        # key -> log(count) - clock * step at its last use: its count at clock t is exp(value + t * step)
        self.value = {k: math.log(c) if c > 0 else -math.inf for k, c in
                      ((k, p / (1.0 - decay)) for k, p in seed.items())}

    def visit(self, layer: int) -> None:
        self.clock += 1

    def used(self, key: Key) -> None:
        shift = self.clock * self.step
        now = math.exp(self.value.get(key, -math.inf) + shift)  # the decayed count now
        self.value[key] = math.log(now + 1.0) - shift

    def score(self, key: Key) -> float:
        return self.value.get(key, -math.inf)


class StaticRule(EvictionRule):
    """LRU over everything but ``hot`` keys, which are kept once loaded (unless nothing else can go)."""

    policy = CachePolicy.STATIC

    def __init__(self, hot: set[Key]) -> None:
        self.hot = hot

    def victim(self, order: Iterable[Slot]) -> Slot | None:
        first = None
        for slot in order:
            if slot.key not in self.hot:
                return slot
            first = slot if first is None else first
        return first


def hot_set(seed: dict[Key, float], size: int) -> set[Key]:
    """The ``size`` keys with the highest use probability (ties: lower layer, then lower id)."""
    ranked = sorted(seed, key=lambda k: (-seed[k], k))
    return set(ranked[: max(size, 0)])


def make_rule(policy: CachePolicy, seed: dict[Key, float] | None, num_slots: int, top_k: int) -> EvictionRule:
    """The eviction rule for ``policy``.

    Args:
        seed: (layer, expert) -> use probability per token (from :func:`seed_from_frequencies`);
            required for every policy but lru.
        num_slots: S, cache slots (static keeps S - 2K hot keys).
        top_k: K.

    Raises:
        ValueError: a seeded policy without ``seed`` (the CLI checks this first, with
        :func:`resolve_policy`).
    """
    if policy == CachePolicy.LRU:
        return EvictionRule()
    if seed is None:
        raise ValueError(f"cache policy {policy.value} needs calibration frequencies")
    if policy == CachePolicy.LFU:
        return LfuRule(seed)
    if policy == CachePolicy.LFRU:
        return LfruRule(seed, top_k)
    return StaticRule(hot_set(seed, num_slots - 2 * top_k))


def seed_from_frequencies(layers: list[int], frequencies: torch.Tensor, top_k: int) -> dict[Key, float]:
    """Use probability per token of each (decoder layer, expert): frequencies [M, E] (top-K
    memberships over the calibration tokens) normalised so each layer's row sums to K."""
    f = frequencies.double()  # [M, E]
    p = f / f.sum(dim=1, keepdim=True).clamp_min(1.0) * top_k  # [M, E]
    return {(layer, e): float(p[m, e]) for m, layer in enumerate(layers) for e in range(p.shape[1])}


def load_seed(model_path: str | Path, explicit: str | None, top_k: int, config=None, layers: list[int] | None = None,
              routers: list[torch.Tensor] | None = None) -> dict[Key, float]:
    """The seed of a frequency policy from the model's calibration file.

    Args:
        config, layers, routers: the running model's config, MoE layer indices and router weights [E, H];
            when given, the file must have been made for this model, checked as the quasi predictor checks
            it (config hash, MoE layers, router fingerprint; predict.calibration_file.check_matches).

    Raises:
        CalibrationError: no calibration file (names `moespec calibrate`), an unreadable one, or one made
            for another model (names `moespec calibrate MODEL` and ``--cache-policy lru``).
    """
    path = find_policy_calibration(model_path, explicit)
    if config is None:
        calib = load_calibration(path)
    else:
        try:
            calib = load_checked(path, config, list(layers or []), routers, model_path)
        except CalibrationError as exc:
            raise CalibrationError(exc.message, f"{exc.hint}, or use --cache-policy lru") from None
    return seed_from_frequencies(list(calib.layers), calib.frequencies, top_k)


def find_policy_calibration(model_path: str | Path, explicit: str | None, policy: CachePolicy | None = None) -> Path:
    """The calibration file a seeded cache policy reads (checked before a model loads).

    Raises:
        CalibrationError: one line naming `moespec calibrate` and the flag that avoids it.
    """
    try:
        return find_calibration(model_path, explicit)
    except CalibrationError:
        name = policy.value if policy is not None else "this"
        raise CalibrationError(
            f"--cache-policy {name} needs expert frequencies from a calibration file for {model_key(model_path)}",
            f"run `moespec calibrate {model_key(model_path)}` first, or use --cache-policy lru",
        ) from None


def resolve_policy(asked: CachePolicy | None, model_path: str | Path, explicit: str | None) -> CachePolicy:
    """The policy to run: ``asked``, or with None DEFAULT_CACHE_POLICY when a calibration file is
    found (else LRU). Call it before loading a model so a missing file fails fast.

    Raises:
        CalibrationError: ``asked`` needs a calibration file and none is found (names `moespec calibrate`).
    """
    if asked is None:
        if not DEFAULT_CACHE_POLICY.needs_calibration:
            return DEFAULT_CACHE_POLICY
        try:
            find_policy_calibration(model_path, explicit)
        except CalibrationError:
            return CachePolicy.LRU
        return DEFAULT_CACHE_POLICY
    if asked.needs_calibration:
        find_policy_calibration(model_path, explicit, asked)
    return asked
