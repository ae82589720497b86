"""`moespec calibrate`: default vectors, expert frequencies and per-layer recall for one model."""

from __future__ import annotations

import math
from typing import Optional

import typer

from moespec.cli.common import (CacheExperts, Data, Device, Dtype, ExpertDtype, GpuMemory, GroupSize, HeldoutTokens,
                                HostThreads, ModelArg, OnMissOpt, Seed, SeqLen, Threads, err_console, handles_errors,
                                register_command, set_threads)
HELP = """Calibrate MODEL for the `quasi` predictor: run text through it and write a calibration file.

Per MoE layer: the default vector of every expert (its mean raw output over the tokens routed to it), how often each expert is used, and the recall@K of the `router` and `quasi` predictors on held-out text. Runs through the offloading runtime in exact mode, so a model larger than the device can be calibrated. `moespec chat MODEL --predictor quasi` finds the file automatically.

Without --data, public-domain text shipped with moespec is used (US State of the Union addresses).

Examples:

  moespec calibrate Qwen/Qwen3-30B-A3B --gpu-memory 8GiB

  moespec calibrate ./my-moe --data corpus.jsonl --tokens 200000 --seq-len 1024

  moespec calibrate ./my-moe --data texts/ --out ./my-moe.calib.safetensors
"""


DEFAULT_TOKENS = 100_000  # more than the shipped text holds (about 60k tokens): by default all of it is used


def register(app: typer.Typer) -> None:
    """Add the `calibrate` command to ``app``."""
    register_command(app, "calibrate", HELP, calibrate)


@handles_errors
def calibrate(
    model: Optional[str] = ModelArg,
    data: Optional[str] = Data,
    tokens: Optional[int] = typer.Option(None, "--tokens", show_default=False,
                                         help="Calibration tokens (default: 100,000, or all the data holds if fewer)."),
    heldout_tokens: Optional[int] = HeldoutTokens,
    seq_len: int = SeqLen,
    out: Optional[str] = typer.Option(None, "--out", help="Calibration file to write; default: where chat looks for it."),
    gpu_memory: Optional[str] = GpuMemory,
    cache_experts: Optional[int] = CacheExperts,
    device: str = Device,
    dtype: str = Dtype,
    expert_dtype: str = ExpertDtype,
    group_size: Optional[int] = GroupSize,
    on_miss: str = OnMissOpt,
    host_threads: Optional[int] = HostThreads,
    seed: int = Seed,
    threads: Optional[int] = Threads,
    cache_policy: str = typer.Option("lru,lfu,lfru,static", "--cache-policy",
                                     help="Cache policies whose hit rate on the held-out tokens the report shows "
                                          "(comma list of lru, lfu, lfru, static)."),
) -> None:
    import time
    from pathlib import Path

    from moespec.calibrate.data import load_text_source, plan_chunks
    from moespec.artifacts import default_calibration_path
    from moespec.predict.calibration_file import ensure_writable, save_calibration
    from moespec.calibrate.run import CalibrateConfig
    from moespec.cli.runtime_opts import build_runtime_config
    from moespec.config import ExecuteMode, Predictor
    from moespec.model_check import load_tokenizer
    from moespec.default_model.checked import load_checked

    set_threads(threads)
    asked = tokens is not None or heldout_tokens is not None  # a note on fewer tokens only when some were asked for
    tokens = DEFAULT_TOKENS if tokens is None else tokens
    cfg = CalibrateConfig(tokens=tokens, heldout_tokens=heldout_tokens, seq_len=seq_len, seed=seed,
                          policies=_policies(cache_policy))
    rcfg = build_runtime_config(device=device, dtype=dtype, expert_dtype=expert_dtype, group_size=group_size,
                                gpu_memory=gpu_memory,
                                cache_experts=cache_experts,
                                predictor=Predictor.NONE, execute=ExecuteMode.EXACT, fetch_threshold=0.0, link_gbps=None,
                                on_miss=on_miss, host_threads=host_threads)
    source = load_text_source(data, seed)  # bad data fails before the model loads
    path = _resolve(model)
    target = ensure_writable(Path(out) if out else default_calibration_path(path))
    tokenizer = load_tokenizer(path, rcfg.dtype)
    plan = plan_chunks(tokenizer, source, cfg.tokens, cfg.heldout_tokens, cfg.seq_len)
    for note in plan.notes if asked else ():
        err_console.print(f"[yellow]note:[/] {note}", highlight=False)
    om, note = load_checked(path, rcfg)  # the default model's weights: checked by their bytes
    if note:
        err_console.print(f"[dim]{note}[/]", highlight=False)
    try:
        _check_context(om, cfg.seq_len)
        _check_room(om, target)
        err_console.print(f"[dim]{path.name}: {len(om.store.moe_layers)} MoE layers × {om.store.num_experts} experts "
                          f"(top-{om.adapter.top_k()}) on {om.device}, {om.cache.num_slots} cache slots; "
                          f"{plan.calib_tokens} calibration + {plan.heldout_tokens} held-out tokens "
                          f"in chunks of {cfg.seq_len}[/]", highlight=False)
        t0 = time.perf_counter()
        result = _run_with_progress(om, plan, cfg, source)
        elapsed = time.perf_counter() - t0
    finally:
        om.close()
    save_calibration(target, result.calibration)
    _render(result, plan, elapsed, target)


def _policies(text: str):
    from moespec.cli.runtime_opts import enum_option
    from moespec.config import CachePolicy
    from moespec.errors import OptionError

    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise OptionError("--cache-policy is empty", "e.g. --cache-policy lru,lfru")
    return tuple(dict.fromkeys(enum_option(CachePolicy, n, "--cache-policy") for n in names))


def _resolve(model: Optional[str]):
    """MODEL's folder (None or the default model named: built on first use, or again after a failed check)."""
    from moespec.default_model.checked import resolve

    return resolve(model, err_console)


def _check_room(om, target) -> None:
    """Refuse now, not after the run, a calibration file the disk cannot hold (its size is known)."""
    from moespec.calibrate.collect import VARIANTS
    from moespec.fsutil import check_free_space

    m, e, h = len(om.store.moe_layers), om.store.num_experts, om.store.layout.hidden
    check_free_space(target, m * e * h * 4 * len(VARIANTS) + m * e * 8 + 65536)  # vectors, frequencies, header


def _check_context(om, seq_len: int) -> None:
    from moespec.errors import OptionError

    if seq_len > om.max_context():
        raise OptionError(f"--seq-len {seq_len} exceeds the model's context of {om.max_context()} tokens",
                          f"use --seq-len {min(512, om.max_context())}")


def _run_with_progress(om, plan, cfg, source):
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

    from moespec.calibrate.run import calibrate

    # narrow bar, short texts: the whole line fits 80 columns (nothing cut by an ellipsis)
    columns = (TextColumn("{task.description}"), BarColumn(bar_width=16), TaskProgressColumn(),
               TextColumn("{task.completed:,.0f}/{task.total:,.0f} tok"),
               TextColumn("{task.fields[rate]}"), TimeRemainingColumn())
    with Progress(*columns, console=err_console, transient=False) as bar:
        tasks = {"calibrate": bar.add_task("calibrating", total=plan.calib_tokens, rate=""),
                 "heldout": bar.add_task("held-out recall", total=plan.heldout_tokens, rate="")}

        def progress(stage: str, done: int, total: int) -> None:
            task = bar.tasks[tasks[stage]]
            bar.update(tasks[stage], completed=done)
            speed = task.speed or (done / task.elapsed if task.elapsed else None)
            if speed:
                bar.update(tasks[stage], rate=f"{speed:,.0f} tok/s")

        heldout_desc = source.description + (" (held-out part)" if source.heldout else " (held-out tail)")
        return calibrate(om, plan, cfg, source.description, heldout_desc, progress)


def _render(result, plan, elapsed: float, target) -> None:
    from rich.console import Console

    from moespec.predict.calibration_file import finite_mean

    from moespec.tables import Column, fit_tables

    out = Console(highlight=False)
    calib = result.calibration
    e = calib.frequencies.shape[1]
    freq = calib.frequencies.double()
    entropies = []
    for m in range(len(calib.layers)):
        p = freq[m] / freq[m].sum().clamp(min=1)
        entropies.append(f"{float(-(p[p > 0] * p[p > 0].log2()).sum()):.2f}")

    def metric(name: str, pred: str) -> list[str]:
        values = [float(v) for v in calib.metric(name, pred)]
        return ["-" if math.isnan(v) else f"{v:.3f}" for v in values]

    key = [Column("layer", [str(layer) for layer in calib.layers])]
    cols = [Column("entropy", entropies), Column("unrouted", [str(int(u)) for u in calib.unrouted]),
            Column("recall\nrouter", metric("recall", "router")), Column("recall\nquasi", metric("recall", "quasi")),
            Column("w-recall\nrouter", metric("weighted_recall", "router")),
            Column("w-recall\nquasi", metric("weighted_recall", "quasi")),
            Column("cos\nrouter", metric("cosine", "router")), Column("cos\nquasi", metric("cosine", "quasi"))]
    title = f"{calib.meta['tokens']:,} calibration tokens · recall on {plan.heldout_tokens:,} held-out tokens"
    for table in fit_tables(title, key, cols, out.width):
        out.print(table)
    out.print(f"[dim]entropy: of the expert frequencies, in bits (max {math.log2(e):.1f}); recall@K, weighted "
              "recall and cosine to the true router input, predicting each layer from the one before[/]")
    r_router, r_quasi = finite_mean(calib.metric("recall", "router")), finite_mean(calib.metric("recall", "quasi"))
    alt = {v: finite_mean(calib.metric("recall", f"quasi_{v}")) for v in calib.default_vectors}
    alts = ", ".join(f"{k} {v:.3f}" for k, v in alt.items())
    out.print(f"mean recall@{calib.meta['top_k']}: router {r_router:.3f} · quasi {r_quasi:.3f} "
              f"(default vectors: {calib.variant}; {alts})", soft_wrap=True)
    if result.policy_hit_rates:
        from rich.table import Table  # 4 narrow columns: fits 80 columns as it is

        from moespec.calibrate.policy_report import FRACTIONS, MAX_TOKENS

        hits = Table(title=f"cache hit rate on-demand, first {MAX_TOKENS} held-out tokens replayed",
                     caption="seeded policies use this file's frequencies (calibration tokens only)")
        hits.add_column("policy")
        for frac in FRACTIONS:
            hits.add_column(f"{frac:.1%} of experts", justify="right")
        for name, rates in result.policy_hit_rates.items():
            hits.add_row(name, *(f"{r:.3f}" for r in rates))
        out.print(hits)
    rate = calib.meta["tokens"] / result.calib_s if result.calib_s > 0 else 0.0
    per_100k = 1e5 / rate if rate else float("nan")
    out.print(f"calibration pass {result.calib_s:.1f} s ({rate:,.0f} tok/s, {per_100k:.1f} s per 100k tokens); "
              f"held-out pass {result.heldout_s:.1f} s; total {elapsed:.1f} s", soft_wrap=True)
    out.print(f"wrote {target}", soft_wrap=True)
