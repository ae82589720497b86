"""Rich tables of a profile report (strategies as rows) and of two reports side by side.

Every table fits the console's width without cutting a number: columns are listed most important
first and wrap into a second table where the width ends (moespec.tables); ``wide`` keeps one table.
"""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from moespec.profile.guard_view import guard_tables
from moespec.tables import Column, fit_tables


def _f(value, fmt: str = ".2f", dash: str = "-") -> str:
    return dash if value is None else format(value, fmt)


def _name(res: dict) -> str:
    return res["strategy"] + (" (bound)" if res["upper_bound"] else "")


def _header(rep: dict) -> list[str]:
    """The run's context in short lines (each fits 80 columns for a model id of up to ~35 chars)."""
    m, link, cache = rep["model"], rep["link"], rep["cache"]
    emu = f" (emulated {link['emulated_gbps']:g})" if link["emulated_gbps"] else ""
    return [f"{m['id']} · {m['moe_layers']} MoE layers × {m['experts']} experts, top-{m['top_k']}",
            f"{m['expert_bytes'] / 1e6:.3f} MB/expert ({m.get('expert_format', m['dtype'])}) · "
            f"cache {cache['slots']} slots, policy {rep['options'].get('cache_policy', 'lru')}",
            f"{rep['hardware']['device']} ({rep['hardware']['device_name']}) · "
            f"{'disk' if link.get('over') == 'disk' else 'link'} {link['measured_gbps']:.3g} GB/s{emu}",
            f"execute {rep['options'].get('execute')} · {rep['options'].get('repeats')} repeats × "
            f"{rep['trace']['gen']} tokens"]


def _rows(rep: dict, plen: int) -> list[dict]:
    return [r for r in rep["results"] if r["prompt_len"] == plen]


def time_tables(rep: dict, plen: int, width: int | None) -> list[Table]:
    """Time per strategy: TPOT, ratio to none, TTFT, stall, distance to the floor, bounds.

    Columns in priority order; at ``width`` they wrap into a second table (None: one table).
    """
    rows = _rows(rep, plen)
    key = [Column("strategy", [_name(r) for r in rows], "left")]
    cols = [
        Column("TPOT\nms", [f"{r['tpot_ms']['mean']:.2f}" for r in rows]),
        Column("±", [f"{r['tpot_ms']['std']:.2f}" for r in rows]),
        Column("×\nnone", [_f(r["tpot_ratio_vs_none"], ".3f") for r in rows]),
        Column("TTFT\nms", [f"{r['ttft_ms']['mean']:.1f}" for r in rows]),
        Column("stall\nms/tok", [f"{r['stall_ms_per_token']:.2f}" for r in rows]),
        Column("to\nfloor", [f"{_f(r['bounds']['distance_ratio'], '.2f')}×" for r in rows]),
        Column("floor\nms", [f"{r['bounds']['floor_ms']:.2f}" for r in rows]),
        Column("on-demand\nms", [f"{r['bounds']['on_demand_ms']:.2f}" for r in rows]),
        Column("tok/s", [f"{r['tokens_per_s']['mean']:.1f}" for r in rows]),
        Column("copy\nshare", [_f(r["bounds"]["copy_share"], ".0%") for r in rows]),
        Column("TTFT\n±", [f"{r['ttft_ms']['std']:.1f}" for r in rows]),
    ]
    return fit_tables(f"prompt {plen} tokens: time", key, cols, width)


def traffic_tables(rep: dict, plen: int, width: int | None) -> list[Table]:
    """Bytes, hits, prediction and quality per strategy (wrapped at ``width`` like time_tables)."""
    rows = _rows(rep, plen)
    key = [Column("strategy", [_name(r) for r in rows], "left")]
    cols = [
        Column("H2D\nMB/tok", [f"{r['h2d_bytes_per_token'] / 1e6:.3f}" for r in rows]),
        Column("hit\nrate", [_f(r["hit_rate"], ".2f") for r in rows]),
        Column("recall\n@K", [_f(r["recall"], ".3f") for r in rows]),
        Column("w.\nrecall", [_f(r["weighted_recall"], ".3f") for r in rows]),
        Column("top-1", [f"{r['quality']['top1_agreement']:.3f}" for r in rows]),
        Column("KL", [f"{r['quality']['kl_mean']:.2e}" for r in rows]),
        Column("link\nGB/s", [_f(r["link_gbps_achieved"], ".3g") for r in rows]),
        Column("over-\nlap", [_f(r["overlap_fraction"], ".0%") for r in rows]),
        Column("prefetch\n/tok", [f"{r['prefetched_per_token']:.1f}" for r in rows]),
        Column("wasted\n/tok", [f"{r['prefetch_wasted_per_token']:.1f}" for r in rows]),
        Column("skipped\n/tok", [f"{r['skipped_per_token']:.1f}" for r in rows]),
    ]
    if any(r.get("disk") for r in rows):  # the experts on disk: what was read from it, how fast
        disk = [r.get("disk") or {} for r in rows]
        cols[1:1] = [Column("disk\nMB/tok", [_f(d.get("bytes_per_token") and d["bytes_per_token"] / 1e6, ".3f")
                                              for d in disk]),
                     Column("disk\nGB/s", [_f(d.get("gbps"), ".3g") for d in disk])]
    return fit_tables(f"prompt {plen} tokens: bytes, prediction, quality vs exact", key, cols, width)


def miss_tables(rep: dict, plen: int, width: int | None) -> list[Table]:
    """Where each strategy's experts ran per decode token (cache, fetched, host), what the host moved,
    and the prefill's fetched / host-computed experts; [] when every strategy fetched its misses."""
    res = [r for r in _rows(rep, plen) if "host" in r]
    if not any(r.get("on_miss", "fetch") != "fetch" for r in res):
        return []
    key = [Column("strategy", [_name(r) for r in res], "left")]
    cols = [
        Column("cache", [f"{r['hits_per_token']:.1f}" for r in res]),
        Column("fetched", [f"{r['misses_per_token']:.1f}" for r in res]),
        Column("host", [f"{r['host']['experts_per_token']:.1f}" for r in res]),
        Column("host\nms", [f"{r['host']['ms_per_token']:.2f}" for r in res]),
        Column("D2H\nKB", [f"{r['host']['d2h_bytes_per_token'] / 1e3:.1f}" for r in res]),
        Column("H2D out\nKB", [f"{r['host']['h2d_bytes_per_token'] / 1e3:.1f}" for r in res]),
        Column("×\nfetch", [_f(r.get("tpot_ratio_vs_fetch"), ".3f") for r in res]),
        Column("prefill\nf/h", [f"{r['host'].get('prefill_fetched', 0):.0f}/{r['host'].get('prefill_host', 0):.0f}"
                                 for r in res]),
    ]
    return fit_tables(f"prompt {plen} tokens: where experts ran (per token)", key, cols, width)


def recall_tables(rep: dict, plen: int, width: int | None) -> list[Table]:
    """recall@K per layer (rows) and predicting strategy (columns); [] when nothing predicted."""
    res = [r for r in _rows(rep, plen) if r["recall"] is not None]
    if not res:
        return []
    layers = sorted({p["layer"] for r in res for p in r["per_layer"]})
    key = [Column("layer", [str(layer) for layer in layers])]
    cols = []
    for r in res:
        by_layer = {p["layer"]: p["recall"] for p in r["per_layer"]}
        cols.append(Column(r["strategy"], [_f(by_layer.get(layer), ".3f") for layer in layers]))
    return fit_tables(f"prompt {plen} tokens: recall@K per layer", key, cols, width)


def hit_tables(rep: dict, plen: int, width: int | None) -> list[Table]:
    """Hit rate per layer (rows): each strategy's run, then each cache policy replaying the exact
    trace on-demand (``policy_hit_rates``); [] when there is nothing to show."""
    res = _rows(rep, plen)
    pol = rep.get("policy_hit_rates", {}).get(str(plen), {})
    if not res and not pol:
        return []
    layers = sorted({p["layer"] for r in res for p in r["per_layer"]} | {int(la) for v in pol.values()
                                                                           for la in v["per_layer"]})

    def rate(p) -> float | None:
        return p["hits"] / (p["hits"] + p["misses"]) if p and p["hits"] + p["misses"] > 0 else None

    key = [Column("layer", [str(layer) for layer in layers] + ["all"])]
    cols = []
    for r in res:
        by_layer = {p["layer"]: p for p in r["per_layer"]}
        cols.append(Column(r["strategy"], [_f(rate(by_layer.get(layer)), ".2f") for layer in layers]
                           + [_f(r["hit_rate"], ".2f")]))
    for name, v in pol.items():
        cols.append(Column(f"{name}\nreplay", [_f(v["per_layer"].get(str(layer)), ".2f") for layer in layers]
                           + [_f(v["hit_rate"], ".2f")]))
    policy = rep["options"].get("cache_policy", "?")
    return fit_tables(f"prompt {plen} tokens: hit rate per layer ({policy} runs; replays)", key, cols, width)


_NOTES = ("× none: TPOT / TPOT of none · to floor: TPOT / floor",
          "floor: Σ max(compute, copy of what was missed) · copy share: copy / on-demand time",
          "oracle replays the exact run's routing (an upper bound)",
          "<policy> replay: the exact trace through an empty cache of this size, on-demand",
          "NAME@τ: guarded at --fetch-threshold τ · ppl: perplexity of the forced tokens",
          "skip mass: share of a token's top-K gate mass skipped, summed over layers")


def render_report(rep: dict, console: Console, wide: bool = False) -> None:
    """Print the tables of ``rep``, wrapped to ``console.width`` unless ``wide`` (one table each)."""
    width = None if wide else console.width
    for line in _header(rep):
        console.print(f"[dim]{escape(line)}[/]")
    for plen in dict.fromkeys(r["prompt_len"] for r in rep["results"]):
        for table in (*time_tables(rep, plen, width), *traffic_tables(rep, plen, width),
                      *miss_tables(rep, plen, width), *guard_tables(rep, plen, width),
                      *recall_tables(rep, plen, width), *hit_tables(rep, plen, width)):
            console.print(table)
    for line in _NOTES:
        console.print(f"[dim]{line}[/]")
    if any(r["strategy"].startswith("mmap") for r in rep["results"]):
        console.print("[dim]mmap: no prediction, rows read through the page cache (a second load)[/]")
    if rep.get("page_cache") == "store file":
        console.print("[dim]not root: only the store file's pages dropped before each run[/]")


def render_compare(a: dict, b: dict, name_a: str, name_b: str, console: Console, wide: bool = False) -> None:
    """Print two reports side by side, one row per (prompt length, strategy) present in either."""
    width = None if wide else console.width
    for tag, name, rep in (("A", name_a, a), ("B", name_b, b)):
        console.print(f"[bold]{tag}[/] {escape(name)}")
        for line in _header(rep):
            console.print(f"  [dim]{escape(line)}[/]")
    diff = sorted(k for k in set(a["options"]) | set(b["options"]) if a["options"].get(k) != b["options"].get(k))
    if diff:
        console.print("[yellow]options that differ:[/] " + escape(", ".join(
            f"{k} {a['options'].get(k)!r} → {b['options'].get(k)!r}" for k in diff)))
    key = lambda r: (r["prompt_len"], r["strategy"])  # noqa: E731
    ra, rb = {key(r): r for r in a["results"]}, {key(r): r for r in b["results"]}
    keys = list(dict.fromkeys([*ra, *rb]))
    pairs = [(ra.get(k), rb.get(k)) for k in keys]

    def col(header: str, value, fmt: str) -> Column:
        return Column(header, [_f(value(x, y), fmt) for x, y in pairs])

    tpot = lambda r: r and r["tpot_ms"]["mean"]  # noqa: E731
    cols = [
        col("TPOT A\nms", lambda x, y: tpot(x), ".1f"), col("TPOT B\nms", lambda x, y: tpot(y), ".1f"),
        col("B/A", lambda x, y: tpot(y) / tpot(x) if tpot(x) and tpot(y) else None, ".3f"),
        col("MB/tok\nA", lambda x, y: x and x["h2d_bytes_per_token"] / 1e6, ".2f"),
        col("MB/tok\nB", lambda x, y: y and y["h2d_bytes_per_token"] / 1e6, ".2f"),
        col("recall\nA", lambda x, y: x and x["recall"], ".2f"),
        col("recall\nB", lambda x, y: y and y["recall"], ".2f"),
        col("top-1\nA", lambda x, y: x and x["quality"]["top1_agreement"], ".2f"),
        col("top-1\nB", lambda x, y: y and y["quality"]["top1_agreement"], ".2f"),
    ]
    first = [Column("P", [str(k[0]) for k in keys]), Column("strategy", [k[1] for k in keys], "left")]
    for table in fit_tables("A vs B (TPOT ms, H2D MB per token, recall@K, top-1)", first, cols, width):
        console.print(table)
