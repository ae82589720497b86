"""Rich tables of a profile report (strategies as rows) and of two reports side by side."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table


def _f(value, fmt: str = ".2f", dash: str = "-") -> str:
    return dash if value is None else format(value, fmt)


def _pm(ms: dict) -> str:
    return f"{ms['mean']:.2f} ± {ms['std']:.2f}"


def _name(res: dict) -> str:
    return res["strategy"] + (" (bound)" if res["upper_bound"] else "")


def _header(rep: dict) -> str:
    m, link, cache = rep["model"], rep["link"], rep["cache"]
    emu = f" (emulated {link['emulated_gbps']:g})" if link["emulated_gbps"] else ""
    return (f"{m['id']} · {m['moe_layers']} MoE layers × {m['experts']} experts, top-{m['top_k']}, "
            f"{m['expert_bytes'] / 1e6:.3f} MB/expert · cache {cache['slots']} slots · "
            f"{rep['hardware']['device']} ({rep['hardware']['device_name']}) · link {link['measured_gbps']:.3g} GB/s{emu} · "
            f"execute {rep['options'].get('execute')} · {rep['options'].get('repeats')} repeats × {rep['trace']['gen']} tokens")


def time_table(rep: dict, plen: int) -> Table:
    """Time per strategy: TTFT, TPOT, ratio to none, stall, bounds, distance to floor."""
    t = Table(title=f"prompt {plen} tokens: time", title_justify="left")
    for col in ("strategy", "TTFT ms", "TPOT ms", "× none", "tok/s", "stall ms/tok", "on-demand ms", "floor ms",
                "to floor", "copy share"):
        t.add_column(col, justify="left" if col == "strategy" else "right")
    for r in (r for r in rep["results"] if r["prompt_len"] == plen):
        b = r["bounds"]
        t.add_row(_name(r), _pm(r["ttft_ms"]), _pm(r["tpot_ms"]), _f(r["tpot_ratio_vs_none"], ".3f"),
                  f"{r['tokens_per_s']['mean']:.1f}", f"{r['stall_ms_per_token']:.2f}", f"{b['on_demand_ms']:.2f}",
                  f"{b['floor_ms']:.2f}", f"{_f(b['distance_ratio'], '.2f')}×", _f(b["copy_share"], ".0%"))
    return t


def traffic_table(rep: dict, plen: int) -> Table:
    """Bytes, hits, prediction and quality per strategy."""
    t = Table(title=f"prompt {plen} tokens: bytes, prediction, quality vs exact", title_justify="left")
    for col in ("strategy", "H2D MB/tok", "link GB/s", "overlap", "hit rate", "recall@K", "w. recall",
                "prefetch/tok", "wasted/tok", "skipped/tok", "top-1", "KL"):
        t.add_column(col, justify="left" if col == "strategy" else "right")
    for r in (r for r in rep["results"] if r["prompt_len"] == plen):
        q = r["quality"]
        t.add_row(_name(r), f"{r['h2d_bytes_per_token'] / 1e6:.3f}", _f(r["link_gbps_achieved"], ".3g"),
                  _f(r["overlap_fraction"], ".0%"), _f(r["hit_rate"], ".2f"), _f(r["recall"], ".3f"),
                  _f(r["weighted_recall"], ".3f"), f"{r['prefetched_per_token']:.1f}",
                  f"{r['prefetch_wasted_per_token']:.1f}", f"{r['skipped_per_token']:.1f}",
                  f"{q['top1_agreement']:.3f}", f"{q['kl_mean']:.2e}")
    return t


def miss_table(rep: dict, plen: int) -> Table | None:
    """Where each strategy's experts ran per decode token (cache, fetched, host), what the host moved,
    and the prefill's fetched / host-computed experts; None when every strategy fetched its misses."""
    res = [r for r in rep["results"] if r["prompt_len"] == plen and "host" in r]
    if not any(r.get("on_miss", "fetch") != "fetch" for r in res):
        return None
    t = Table(title=f"prompt {plen} tokens: where experts ran (per token)", title_justify="left")
    for col in ("strategy", "cache", "fetched", "host", "host ms", "D2H KB", "H2D out KB", "× fetch",
                "prefill f/h"):
        t.add_column(col, justify="left" if col == "strategy" else "right")
    for r in res:
        h = r["host"]
        t.add_row(_name(r), f"{r['hits_per_token']:.1f}", f"{r['misses_per_token']:.1f}",
                  f"{h['experts_per_token']:.1f}", f"{h['ms_per_token']:.2f}", f"{h['d2h_bytes_per_token'] / 1e3:.1f}",
                  f"{h['h2d_bytes_per_token'] / 1e3:.1f}", _f(r.get("tpot_ratio_vs_fetch"), ".3f"),
                  f"{h.get('prefill_fetched', 0):.0f}/{h.get('prefill_host', 0):.0f}")
    return t


def recall_table(rep: dict, plen: int) -> Table | None:
    """recall@K per layer (rows) and predicting strategy (columns); None when nothing predicted."""
    res = [r for r in rep["results"] if r["prompt_len"] == plen and r["recall"] is not None]
    if not res:
        return None
    title = f"prompt {plen} tokens: recall@K per layer"
    t = Table(title=title, title_justify="left", min_width=len(title) + 2)
    t.add_column("layer", justify="right")
    for r in res:
        t.add_column(r["strategy"], justify="right")
    layers = sorted({p["layer"] for r in res for p in r["per_layer"]})
    for layer in layers:
        cells = []
        for r in res:
            p = next((p for p in r["per_layer"] if p["layer"] == layer), None)
            cells.append(_f(p["recall"] if p else None, ".3f"))
        t.add_row(str(layer), *cells)
    return t


def render_report(rep: dict, console: Console) -> None:
    """Print the tables of ``rep``."""
    console.print(f"[dim]{_header(rep)}[/]")
    for plen in dict.fromkeys(r["prompt_len"] for r in rep["results"]):
        console.print(time_table(rep, plen))
        console.print(traffic_table(rep, plen))
        mt = miss_table(rep, plen)
        if mt is not None:
            console.print(mt)
        rt = recall_table(rep, plen)
        if rt is not None:
            console.print(rt)
    console.print("[dim]× none: TPOT / TPOT of none · floor: Σ max(compute, copy of what was missed) · "
                  "copy share: copy / on-demand time · oracle replays the exact run's routing (an upper bound)[/]")


def render_compare(a: dict, b: dict, name_a: str, name_b: str, console: Console) -> None:
    """Print two reports side by side, one row per (prompt length, strategy) present in either."""
    console.print(f"[bold]A[/] {name_a}: [dim]{_header(a)}[/]")
    console.print(f"[bold]B[/] {name_b}: [dim]{_header(b)}[/]")
    diff = sorted(k for k in set(a["options"]) | set(b["options"]) if a["options"].get(k) != b["options"].get(k))
    if diff:
        console.print("[yellow]options that differ:[/] " + ", ".join(
            f"{k} {a['options'].get(k)!r} → {b['options'].get(k)!r}" for k in diff))
    t = Table(title="A vs B (TPOT ms, H2D MB per token, recall@K, top-1)", title_justify="left",
              box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("P", "strategy", "TPOT A", "TPOT B", "B/A", "MB A", "MB B",
                "rec A", "rec B", "top1 A", "top1 B"):
        t.add_column(col, justify="left" if col == "strategy" else "right", no_wrap=col == "strategy")
    key = lambda r: (r["prompt_len"], r["strategy"])  # noqa: E731
    ra, rb = {key(r): r for r in a["results"]}, {key(r): r for r in b["results"]}
    for k in list(dict.fromkeys([*ra, *rb])):
        x, y = ra.get(k), rb.get(k)
        tx = x["tpot_ms"]["mean"] if x else None
        ty = y["tpot_ms"]["mean"] if y else None
        t.add_row(str(k[0]), k[1], _f(tx, ".1f"), _f(ty, ".1f"),
                  _f(ty / tx if tx and ty else None, ".3f"),
                  _f(x and x["h2d_bytes_per_token"] / 1e6, ".2f"), _f(y and y["h2d_bytes_per_token"] / 1e6, ".2f"),
                  _f(x and x["recall"]), _f(y and y["recall"]),
                  _f(x and x["quality"]["top1_agreement"]), _f(y and y["quality"]["top1_agreement"]))
    console.print(t)
