"""Guarded mode against exact, per τ: the numbers (``vs_exact`` in the report) and their table.

With ``--execute guarded`` every strategy runs once in `exact` and once per ``--fetch-threshold``
value (strategy.guard_arms), on the same teacher-forced tokens. A guarded arm ``NAME@τ`` is compared
with the exact arm ``NAME`` of the same prompt length: H2D bytes per token (and the share saved),
skipped gate mass, top-1 agreement and KL(exact || guarded) of the next-token distributions (from
the run itself), and the perplexity of the trace's targets as a ratio to exact's.
"""

from __future__ import annotations

from rich.table import Table

from moespec.profile.strategy import base_name
from moespec.tables import Column, fit_tables


def _exact_of(res: dict, results: list[dict]) -> dict | None:
    base = base_name(res["strategy"])
    return next((r for r in results if r["strategy"] == base and r["prompt_len"] == res["prompt_len"]
                 and r["execute"] == "exact"), None)


def add_vs_exact(results: list[dict]) -> None:
    """Fill ``vs_exact`` of every guarded arm that has its exact arm: {h2d_ratio, bytes_saved,
    perplexity_ratio} (ratios guarded / exact; None where exact's value is 0)."""
    for res in results:
        if res.get("fetch_threshold") is None:
            continue
        ref = _exact_of(res, results)
        if ref is None:
            continue
        eb, gb = ref["h2d_bytes_per_token"], res["h2d_bytes_per_token"]
        ep, gp = ref["quality"]["perplexity"], res["quality"]["perplexity"]
        res["vs_exact"] = {"h2d_ratio": gb / eb if eb else None, "bytes_saved": 1 - gb / eb if eb else None,
                           "perplexity_ratio": gp / ep if ep else None}


def _f(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def guard_rows(rep: dict, plen: int) -> list[dict]:
    """The exact arms that have guarded arms, each followed by its guarded arms (τ ascending)."""
    rows = [r for r in rep["results"] if r["prompt_len"] == plen]
    guarded = [r for r in rows if r.get("fetch_threshold") is not None]
    out: list[dict] = []
    for base in dict.fromkeys(base_name(r["strategy"]) for r in guarded):
        ref = [r for r in rows if r["strategy"] == base and r["execute"] == "exact"]
        arms = sorted((r for r in guarded if base_name(r["strategy"]) == base), key=lambda r: r["fetch_threshold"])
        out.extend(ref + arms)
    return out


def guard_tables(rep: dict, plen: int, width: int | None) -> list[Table]:
    """Per τ: H2D MB/token, bytes saved, top-1, perplexity and its ratio to exact's, KL, skipped gate
    mass per token and per layer (experts skipped per token are in the traffic table); [] when the
    report has no guarded arm."""
    rows = guard_rows(rep, plen)
    if not rows:
        return []
    vs = [r.get("vs_exact") or {} for r in rows]
    key = [Column("strategy", [r["strategy"] for r in rows], "left")]
    cols = [
        Column("H2D\nMB/tok", [f"{r['h2d_bytes_per_token'] / 1e6:.2f}" for r in rows]),
        Column("bytes\nsaved", [_f(v.get("bytes_saved"), ".1%") for v in vs]),
        Column("top-1", [f"{r['quality']['top1_agreement']:.3f}" for r in rows]),
        Column("ppl", [f"{r['quality']['perplexity']:.2f}" for r in rows]),
        Column("ppl\n×exact", [_f(v.get("perplexity_ratio"), ".4f") for v in vs]),
        Column("KL", [f"{r['quality']['kl_mean']:.0e}" for r in rows]),
        Column("skip\nmass", [f"{r.get('skipped_mass_per_token', 0.0):.3f}" for r in rows]),
        Column("per\nlayer", [f"{r.get('skipped_mass_per_layer', 0.0):.4f}" for r in rows]),
    ]
    return fit_tables(f"prompt {plen} tokens: guarded NAME@τ vs exact NAME", key, cols, width)
