"""`moespec profile`: strategies side by side on one deterministic token trace."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Tuple

import typer

from moespec.cli.common import (CacheExperts, CachePolicyOpt, DenseDtype, Device, Dtype, EstimatorPath, ExpertDtype,
                                Flag, GpuMemory, GroupSize, GuardRuleOpt, HostMemory, HostThreads, LinkGbps, Seed, Threads,
                                err_console, handles_errors, print_notes, register_command, set_threads)
from moespec.config import DEFAULT_FETCH_THRESHOLD

HELP = """Run prefetch strategies side by side on one token trace: where every ms and byte went.

TTFT, TPOT (mean ± std), stall, H2D bytes, link GB/s, overlap, hit rate, recall@K per layer,
quality against `exact`, and the on-demand / perfect-overlap bounds. At 80 columns the tables
show the main columns (wrapped into two tables where needed); --wide prints every column.

Every strategy prefills the same prompt and is teacher-forced on the `exact` run's greedy tokens
(--decode-inputs text: on the text's own next tokens).
`oracle` replays the exact run's true routing: the best any predictor could do with the same memory.

With --execute guarded, each strategy runs in `exact` and once per --fetch-threshold value (a
comma list), and a table shows per τ the H2D bytes, skipped gate mass, top-1 agreement, KL and
perplexity against exact.

Examples:

  moespec profile ./Qwen3-30B-A3B --gpu-memory 4GiB --strategies none,router,quasi,oracle --out report.json

  moespec profile MODEL --device cpu --link-gbps 0.5 --cache-experts 64 --prompt-len 64,256 --gen 16
  --plot report.png --trace step.json

  moespec profile MODEL --strategies quasi,hybrid --estimator estimators.safetensors

  moespec profile --cache-experts 8 --link-gbps 0.09 --strategies none,router --on-miss fetch,host,auto

  moespec profile MODEL --strategies none,router+auto,router+host

  moespec profile --cache-experts 120 --execute guarded --fetch-threshold 0,0.05,0.1,0.2 --strategies none
  --decode-inputs text --gen 256 --plot guard.png

  moespec profile --device cpu --host-memory 64MiB --strategies none,router --trace disk.json
  (experts on disk: the RAM tier holds 64 MiB of rows; the trace's copy lane is the disk reader)

  scripts/memcap.sh run 1G moespec profile --device cpu --host-memory 200MiB
  --strategies none,router,mmap
  (under a 1 GiB memory cgroup: on-demand reads, router prefetch and the mmap baseline, the
  store file read through the page cache on a second load; the page cache dropped before each
  run as root)

  moespec profile --compare before.json after.json
"""


_WIDE = 400  # columns of the --wide console: more than any profile table needs


def register(app: typer.Typer) -> None:
    """Add the `profile` command to ``app``."""
    register_command(app, "profile", HELP, profile)


def _ints(text: str, flag: str) -> tuple[int, ...]:
    from moespec.errors import OptionError

    try:
        values = tuple(dict.fromkeys(int(v) for v in text.split(",") if v.strip()))
    except ValueError:
        raise OptionError(f"{flag} {text!r} is not a list of integers", f"e.g. {flag} 128,1024") from None
    if not values:
        raise OptionError(f"{flag} is empty", f"e.g. {flag} 128")
    return values


@handles_errors
def profile(
    model: Optional[str] = typer.Argument(None, help="Local folder or Hub id in the local cache; default: the embedded model."),
    strategies: str = typer.Option("none,router,oracle", "--strategies", "-s",
                                   help="Comma list of none, router, quasi, estimator, hybrid, oracle; "
                                        "PRED+ONMISS (router+host) fixes where its misses run; mmap (with "
                                        "--host-memory): the store file read through the page cache."),
    on_miss: str = typer.Option("fetch", "--on-miss",
                                help="Comma list of fetch, host, auto: every bare strategy runs with each "
                                     "(fetch keeps the plain name, others are named PRED+ONMISS)."),
    host_threads: Optional[int] = HostThreads,
    prompt_len: str = typer.Option("128", "--prompt-len", help="Prompt length(s) in tokens, comma list."),
    gen: int = typer.Option(32, "--gen", help="Decode steps per run (teacher-forced)."),
    repeats: int = typer.Option(3, "--repeats", help="Timed runs per strategy (mean ± std)."),
    warmup: int = typer.Option(2, "--warmup", help="Decode steps of the untimed warm-up run per strategy."),
    execute: str = typer.Option("exact", "--execute", help="exact, speculative or guarded. exact equals transformers' default experts implementation at the same dtype (top-k outputs summed in float32, rounded once)."),
    fetch_threshold: Optional[str] = typer.Option(
        None, "--fetch-threshold", show_default=False,
        help=f"guarded mode: τ, or a comma list of τ values compared with exact (default {DEFAULT_FETCH_THRESHOLD:g})."),
    guard_rule: str = GuardRuleOpt,
    decode_inputs: str = typer.Option("greedy", "--decode-inputs",
                                      help="What decode steps are fed: greedy (the exact run's tokens) or text "
                                           "(the text's next tokens, for a held-out perplexity)."),
    cache_policy: Optional[str] = CachePolicyOpt,
    gpu_memory: Optional[str] = GpuMemory,
    host_memory: Optional[str] = HostMemory,
    cache_experts: Optional[int] = CacheExperts,
    device: str = Device,
    dtype: str = Dtype,
    expert_dtype: str = ExpertDtype,
    dense_dtype: str = DenseDtype,
    group_size: Optional[int] = GroupSize,
    link_gbps: Optional[float] = LinkGbps,
    copy_share: Optional[float] = typer.Option(
        None, "--copy-share", help="Set the emulated link (CPU) so on-demand copies are this share of on-demand "
                                   "TPOT, from an unthrottled on-demand probe in the same run (e.g. 0.75; replaces --link-gbps)."),
    calibration: Optional[str] = typer.Option(None, "--calibration", help="Calibration file for quasi / hybrid."),
    estimator: Optional[str] = EstimatorPath,
    data: Optional[str] = typer.Option(None, "--data", help="Text file for the prompt (default: shipped held-out text)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write the JSON report here."),
    plot: Optional[Path] = typer.Option(None, "--plot", help=r"Write a PNG plot here (needs matplotlib: pip install 'moespec\[plot]')."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="Write a Chrome/Perfetto trace of one decode step."),
    force: bool = Flag("--force", help="Overwrite existing output files."),
    compare: Optional[Tuple[Path, Path]] = typer.Option(None, "--compare", help="Show two saved reports side by side."),
    wide: bool = Flag("--wide", help="One table per topic with every column, however wide (default: fit the "
                                     "terminal, wrapping columns into a second table)."),
    threads: Optional[int] = Threads,
    seed: int = Seed,
) -> None:
    from rich.console import Console

    from moespec.cli.runtime_opts import check_predictor_files
    from moespec.config import RuntimeConfig
    from moespec.errors import OptionError

    # --wide: a console wide enough for any table, so Rich never shrinks a column
    out_console = Console(highlight=False, width=_WIDE if wide else None)
    if compare:
        from moespec.profile.render import render_compare
        from moespec.profile.report import load_report

        render_compare(load_report(compare[0]), load_report(compare[1]), str(compare[0]), str(compare[1]), out_console,
                       wide=wide)
        return
    from moespec.profile.copy_share import check_copy_share

    check_copy_share(copy_share, device)
    # a missing calibration/estimator file is refused first, before torch loads (under a second)
    from moespec.profile.strategy import parse_on_miss_list, parse_strategies

    chosen = parse_strategies(strategies, parse_on_miss_list(on_miss))  # also checks the names, before loading
    check_predictor_files(model, RuntimeConfig(calibration_path=calibration, estimator_path=estimator),
                          [s.predictor for s in chosen])
    from moespec.profile.report import check_writable

    for path, flag in ((out, "--out"), (plot, "--plot"), (trace, "--trace")):
        check_writable(path, force, flag)
    if plot is not None:
        from moespec.profile.plot import require_matplotlib

        require_matplotlib()
    if gen < 1 or repeats < 1 or warmup < 0:
        raise OptionError("--gen and --repeats must be at least 1, --warmup at least 0")

    report, timelines = _run(model, strategies, on_miss, host_threads, prompt_len, gen, repeats, warmup, execute,
                             fetch_threshold, gpu_memory,
                             cache_experts, device, dtype, link_gbps, calibration, estimator, data, seed,
                             trace is not None, threads, expert_dtype, group_size, cache_policy, guard_rule,
                             decode_inputs, copy_share, dense_dtype, host_memory)
    from moespec.profile.render import render_report
    from moespec.profile.report import write_json

    render_report(report, out_console, wide=wide)
    for res in report["results"]:  # where the prediction gate stopped predicting, and why
        closed = [g for g in res.get("gate") or () if not g["open"]]
        if closed:
            out_console.print(f"{res['strategy']} (prompt {res['prompt_len']}): prediction gated at layer "
                              + ", ".join(f"{_gate_source(g['layer'])} ({g['why']})" for g in closed))
    share = report.get("copy_share")
    if share:
        reached = ", ".join(f"{v:.2f} at prompt {p}" for p, v in share["reached"].items() if v is not None)
        out_console.print(f"copies: share asked {share['asked']:.2f}, reached {reached or 'n/a (no none arm)'}; "
                          f"link set to {share['link_gbps']:.3g} GB/s")
    if out is not None:
        write_json(out, report, force=True)
        err_console.print(f"[dim]report written to {out}[/]")
    if plot is not None:
        from moespec.profile.plot import write_plot

        write_plot(report, plot)
        err_console.print(f"[dim]plot written to {plot}[/]")
    if trace is not None:
        from moespec.profile.chrome_trace import write_chrome_trace

        write_chrome_trace(timelines, trace)
        err_console.print(f"[dim]trace written to {trace} (open it in https://ui.perfetto.dev)[/]")


def _run(model, strategies, on_miss, host_threads, prompt_len, gen, repeats, warmup, execute, fetch_threshold,
         gpu_memory, cache_experts, device, dtype, link_gbps, calibration, estimator, data, seed, timeline, threads,
         expert_dtype="auto", group_size=None, cache_policy=None, guard_rule="budget", decode_inputs="greedy",
         copy_share=None, dense_dtype="auto", host_memory=None):
    """Check the predictors' files, load the model, run the profile; returns (report dict, timelines)."""
    import dataclasses
    import gc

    from moespec.cli.runtime_opts import build_runtime_config, check_estimator_use, enum_option, threshold_list
    from moespec.config import ExecuteMode, OnMiss, Predictor
    from moespec.errors import OptionError
    from moespec.profile.strategy import guard_arms, parse_on_miss_list, parse_strategies
    from moespec.profile.trace import DecodeInputs

    chosen = parse_strategies(strategies, parse_on_miss_list(on_miss))
    check_estimator_use(estimator, [s.predictor for s in chosen])
    prompt_lens = _ints(prompt_len, "--prompt-len")
    mode = enum_option(ExecuteMode, execute, "--execute")
    forced = enum_option(DecodeInputs, decode_inputs, "--decode-inputs")
    taus = threshold_list(fetch_threshold)
    if mode == ExecuteMode.GUARDED:
        chosen = guard_arms(chosen, taus)  # exact + one arm per τ, for each strategy
    elif len(taus) > 1:
        raise OptionError(f"--fetch-threshold {fetch_threshold} is a list, but only guarded arms use it",
                          "add --execute guarded, or pass one value")
    if host_memory is not None:  # experts on disk: say it before loading (use_policy checks it again)
        from moespec.runtime.host.disk_store import check_on_miss

        for s in chosen:
            check_on_miss(s.on_miss)
    predicting = any(s.predictor != Predictor.NONE for s in chosen)
    # Every strategy runs with the same cache; size it for prefetching if any strategy prefetches.
    cfg = build_runtime_config(
        device=device, dtype=dtype, gpu_memory=gpu_memory, cache_experts=cache_experts,
        predictor=Predictor.ROUTER if predicting else Predictor.NONE, execute=mode,
        fetch_threshold=taus[0], link_gbps=link_gbps, calibration=calibration, estimator=estimator,
        expert_dtype=expert_dtype, group_size=group_size, cache_policy=cache_policy, host_threads=host_threads,
        guard_rule=guard_rule, dense_dtype=dense_dtype, host_memory=host_memory)
    set_threads(threads)
    import torch

    from moespec.profile.report import build_report, describe
    from moespec.profile.run import ProfileConfig, run_profile
    from moespec.profile.trace import check_lengths
    from moespec.predict.factory import make_predictor
    from moespec.default_model.checked import load_checked
    from moespec.profile.strategy import MMAP
    from moespec.runtime.host.disk_store import DiskStore

    path, model_id = _resolve(model)
    torch.manual_seed(seed)
    om, note = load_checked(path, cfg)  # the default model's weights: checked by their bytes
    if note:
        err_console.print(f"[dim]{note}[/]", highlight=False)
    direct = tuple(s for s in chosen if s.reads != MMAP)
    mapped = tuple(s for s in chosen if s.reads == MMAP)
    try:
        if mapped and not isinstance(om.store, DiskStore):
            raise OptionError("--strategies mmap needs the experts on disk (it reads the store file through "
                              "the page cache)", "add --host-memory SIZE (e.g. 200MiB) with --device cpu")
        check_lengths(list(prompt_lens), gen, om.max_context())
        refs, loaded = om.layer_refs(), None
        if any(s.on_miss != OnMiss.FETCH for s in chosen):
            loaded = om.policy  # starts the host pool and benchmarks the costs, once, before any run
            om.use_policy(dataclasses.replace(loaded, on_miss=OnMiss.AUTO))
            om.use_policy(dataclasses.replace(loaded, on_miss=OnMiss.FETCH))
        made = {}
        for p in dict.fromkeys(s.predictor for s in direct):
            if p != Predictor.ORACLE:  # the oracle is built from each trace's exact run
                made[p] = make_predictor(p, om.adapter, refs, dataclasses.replace(cfg, predictor=p), path)
        predictors = {s.name: made[s.predictor] for s in direct if s.predictor in made}
        print_notes(om.notes)
        if om.cache.num_slots >= len(om.store.moe_layers) * om.store.num_experts:
            err_console.print("[yellow]note:[/] the cache holds every expert, so little is offloaded; "
                              "pass --gpu-memory or --cache-experts to profile offloading")
        from moespec.gguf.layout import row_format as expert_format

        err_console.print(
            f"[dim]{Path(path).name}: {len(om.store.moe_layers)} MoE layers × {om.store.num_experts} experts "
            f"(top-{om.adapter.top_k()}), {om.cache.num_slots} cache slots of {om.store.expert_bytes / 1e6:.3f} MB "
            f"({expert_format(om.store.layout, om.dtype)}) "
            f"on {om.device}, cache policy {om.cache.policy.value}"
            + (f", dense linears {dense_dtype}" if dense_dtype not in (None, "auto") else "") + "[/]")
        pcfg = ProfileConfig(strategies=chosen, prompt_lens=prompt_lens, gen=gen, repeats=repeats,
                             warmup_steps=warmup, execute=mode, data=data, seed=seed, timeline=timeline,
                             decode_inputs=forced, copy_share=copy_share)
        progress = lambda msg: err_console.print(f"[dim]{msg}[/]")  # noqa: E731
        prof = run_profile(om, _tokenizer(path), dataclasses.replace(pcfg, strategies=direct), predictors,
                           progress=progress)
        host_threads_used = om.planner.pool.threads if om.planner is not None else None
        description, policy = describe(om, model_id), om.cache.policy.value
        hit_rates = _policy_hit_rates(om, path, calibration, prof)
        if mapped:  # the mmap baseline: a second load reading the store file through the page cache
            om.close()
            # Every reference to the first model goes before the second load (the same cap for each arm).
            om = refs = made = predictors = loaded = None  # noqa: F841
            gc.collect()
            progress("mmap: loading the model again, the store file read through the page cache")
            om, _ = load_checked(path, dataclasses.replace(cfg, disk_reads=MMAP))
            none = {s.name: make_predictor(Predictor.NONE, om.adapter, om.layer_refs(), cfg, path) for s in mapped}
            second = run_profile(om, _tokenizer(path), dataclasses.replace(pcfg, strategies=mapped, copy_share=None),
                                 none, progress=progress, reuse=prof.traces)
            prof.runs.extend(second.runs)
            prof.timelines.extend(second.timelines)
        options = {"strategies": [s.name for s in chosen], "host_threads": host_threads_used,
                   "prompt_len": list(prompt_lens), "gen": gen,
                   "repeats": repeats, "warmup": warmup, "execute": mode.value,
                   "fetch_threshold": taus[0] if len(taus) == 1 else list(taus), "guard_rule": cfg.guard_rule.value,
                   "decode_inputs": forced.value,
                   "gpu_memory": gpu_memory, "host_memory": host_memory, "cache_experts": cache_experts,
                   "device": device, "dtype": dtype,
                   "expert_dtype": expert_dtype, "dense_dtype": dense_dtype, "group_size": group_size,
                   "link_gbps": link_gbps, "copy_share": copy_share, "calibration": calibration,
                   "estimator": estimator, "data": data,
                   "seed": seed, "threads": torch.get_num_threads(), "cache_policy": policy}
        report = build_report(description, options, pcfg, prof)
        report["policy_hit_rates"] = hit_rates
        return report, prof.timelines
    finally:
        if om is not None:
            om.close()


def _policy_hit_rates(om, path, calibration, prof) -> dict:
    """prompt length (str) -> policy -> hit rates of the exact trace replayed on-demand (profile/policies.py)."""
    from moespec.errors import CalibrationError
    from moespec.profile.policies import policy_hit_rates
    from moespec.runtime.cache.eviction import load_seed

    k = om.adapter.top_k()
    refs = om.layer_refs()
    try:  # only this model's frequencies (a stale file: no seeded replays)
        seed = load_seed(path, calibration, k, om.config, [r.layer for r in refs], [r.block.gate.weight for r in refs])
    except CalibrationError:
        seed = None
    return {str(plen): policy_hit_rates(t.routings, om.cache.num_slots, k, seed) for plen, t in prof.traces.items()}


def _resolve(model: Optional[str]) -> tuple[Path, str]:
    """MODEL's folder (None: the default model, built on first use) and how the report names it."""
    from moespec.default_model.checked import resolve

    return resolve(model, err_console), ("moespec default model" if model is None else model)


def _tokenizer(path: Path):
    """The model's tokenizer, or None when the folder has none (then the prompt is seeded random ids).

    Checks for tokenizer files first: transformers 5 would otherwise build an empty tokenizer.
    """
    from transformers import AutoTokenizer

    from moespec.model_check import TOKENIZER_FILES

    if not any((Path(path) / f).exists() for f in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _gate_source(layer: int) -> str:
    """A gate report's source as a user reads it: a layer index, or the token start (its key, -1)."""
    from moespec.runtime.layer.token_start import TOKEN_START

    return "the token start" if layer == TOKEN_START else str(layer)
