"""Profile strategies: a predictor and where its misses run (``--strategies``, ``--on-miss``).

A strategy is written ``PREDICTOR`` or ``PREDICTOR+ONMISS`` (``router+host``, ``none+auto``). A
bare predictor runs once per ``--on-miss`` value (default ``fetch``), so
``--strategies none,router --on-miss fetch,host,auto`` compares six side by side. A fetch strategy
keeps the plain predictor name (``none``, ``router``: today's reports read the same).

With ``--execute guarded`` and ``--fetch-threshold`` values τ1,τ2,..., every strategy runs once in
`exact` (its plain name: the reference) and once guarded per τ (named ``NAME@τ``, e.g. ``none@0.05``),
all on the same trace, so bytes and quality of each τ are compared with exact's (guard_arms).

``mmap`` is the baseline of the disk tier (``--host-memory``): no prediction, the store file read
through the OS page cache (a read-only mapping, a page fault per page, as llama.cpp reads its
GGUF) instead of O_DIRECT; it runs on a second load of the model (profile_cmd), on the same trace.
"""

from __future__ import annotations

from dataclasses import dataclass

from moespec.config import ExecuteMode, OnMiss, Predictor
from moespec.errors import OptionError


MMAP = "mmap"  # the strategy name of the mmap baseline (Strategy.reads)


@dataclass(frozen=True)
class Strategy:
    """One profiled arm.

    Attributes:
        predictor: what predicts the next layer's experts.
        on_miss: where a miss runs.
        execute: the execution mode of this arm (None: the profile's ``--execute``).
        threshold: τ of a guarded arm (None: the runtime's ``--fetch-threshold``).
        reads: how the disk tier reads rows: "direct" (O_DIRECT, the loaded model) or "mmap" (the
            page cache; predictor NONE, on a second load with RuntimeConfig.disk_reads "mmap").
    """

    predictor: Predictor
    on_miss: OnMiss = OnMiss.FETCH
    execute: ExecuteMode | None = None
    threshold: float | None = None
    reads: str = "direct"

    @property
    def name(self) -> str:
        """``router`` for fetch, ``router+host`` otherwise (the report's ``strategy``); ``@τ`` for a guarded arm."""
        p = MMAP if self.reads == MMAP else self.predictor.value
        base = p if self.on_miss == OnMiss.FETCH else f"{p}+{self.on_miss.value}"
        return base if self.threshold is None else f"{base}@{self.threshold:g}"

    @property
    def value(self) -> str:
        """The name (reads like Predictor.value where strategies were predictors)."""
        return self.name


def base_name(strategy: str) -> str:
    """A strategy's name without ``@τ``: the exact arm a guarded arm (``router@0.2``) is compared with."""
    return strategy.split("@")[0]


def _choice(kind, text: str, flag: str, more: tuple[str, ...] = ()):
    try:
        return kind(text)
    except ValueError:
        choices = ", ".join([m.value for m in kind] + list(more))
        raise OptionError(f"{flag} {text!r} is not valid", f"choose from: {choices}") from None


def parse_on_miss_list(text: str) -> tuple[OnMiss, ...]:
    """``fetch,host,auto`` -> OnMiss values in order, duplicates dropped.

    Raises:
        OptionError: empty, or an unknown value (names --on-miss).
    """
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise OptionError("--on-miss is empty", "e.g. --on-miss fetch,host,auto")
    return tuple(dict.fromkeys(_choice(OnMiss, n, "--on-miss") for n in names))


def parse_strategies(text: str, on_miss: tuple[OnMiss, ...] = (OnMiss.FETCH,)) -> tuple[Strategy, ...]:
    """Strategies of ``--strategies`` crossed with the ``--on-miss`` list, in the order given.

    Raises:
        OptionError: empty, unknown predictor or on-miss value, mmap with an on-miss other than
            fetch (names --strategies).
    """
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise OptionError("--strategies is empty", "e.g. --strategies none,router,oracle or router+host")
    out: list[Strategy] = []
    for name in names:
        pred, _, where = name.partition("+")
        if pred.strip() == MMAP:  # the baseline fetches its misses: nothing else reads the page cache
            if where and where.strip() != OnMiss.FETCH.value:
                raise OptionError(f"--strategies {name!r} is not valid", "mmap runs with fetch only: write mmap")
            s = Strategy(Predictor.NONE, OnMiss.FETCH, reads=MMAP)
            if s not in out:
                out.append(s)
            continue
        predictor = _choice(Predictor, pred.strip(), "--strategies", (MMAP,))
        modes = (_choice(OnMiss, where.strip(), "--strategies"),) if where else on_miss
        for m in modes:
            s = Strategy(predictor, m)
            if s not in out:
                out.append(s)
    return tuple(out)


def guard_arms(strategies: tuple[Strategy, ...], thresholds: tuple[float, ...]) -> tuple[Strategy, ...]:
    """Each strategy as an `exact` arm (the reference) followed by one guarded arm per τ."""
    out: list[Strategy] = []
    for s in strategies:
        out.append(Strategy(s.predictor, s.on_miss, ExecuteMode.EXACT, reads=s.reads))
        out.extend(Strategy(s.predictor, s.on_miss, ExecuteMode.GUARDED, tau, s.reads) for tau in thresholds)
    return tuple(out)
