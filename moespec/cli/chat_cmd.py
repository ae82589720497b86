"""`moespec chat`: interactive or one-shot chat through the offloading runtime."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from typing import Optional

import typer

from moespec.cli.common import (CacheExperts, Device, Dtype, EstimatorPath, ExpertDtype, FetchThreshold, GpuMemory,
                                HostThreads, LinkGbps, ModelArg, OnMissOpt, Seed, Threads, err_console,
                                handles_errors, set_threads)

HELP = """Chat with an MoE model whose experts are offloaded to host memory.

With no MODEL, the embedded default model (a small real MoE built from SmolLM2-135M-Instruct)
is built on first use and then loaded from moespec's cache.

Examples:

  moespec chat --prompt "What is the capital of France?"

  moespec chat ./Qwen3-30B-A3B --gpu-memory 8GiB --predictor router

  moespec chat MODEL --cache-experts 16 --link-gbps 25 --prompt "Hi" --json

  moespec chat MODEL --predictor hybrid --estimator estimators.safetensors

  moespec chat MODEL --cache-experts 8 --on-miss auto --prompt "Hi"

In the REPL: /reset clears the history, /stats shows per-layer statistics, /exit quits.
"""


def register(app: typer.Typer) -> None:
    """Add the `chat` command to ``app``."""
    app.command("chat", help=HELP)(chat)


@handles_errors
def chat(
    model: Optional[str] = ModelArg,
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Answer this once and exit."),
    json_out: bool = typer.Option(False, "--json", help="With --prompt: print one JSON object (text + stats)."),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt."),
    gpu_memory: Optional[str] = GpuMemory,
    cache_experts: Optional[int] = CacheExperts,
    predictor: str = typer.Option("router", "--predictor", help="none, router, quasi, estimator or hybrid."),
    execute: str = typer.Option("exact", "--execute", help="exact, speculative or guarded. exact equals transformers' default experts implementation at the same dtype (top-k outputs summed in float32, rounded once)."),
    fetch_threshold: float = FetchThreshold,
    device: str = Device,
    dtype: str = Dtype,
    expert_dtype: str = ExpertDtype,
    link_gbps: Optional[float] = LinkGbps,
    calibration: Optional[str] = typer.Option(None, "--calibration", help="Calibration file for --predictor quasi (default: found automatically)."),
    estimator: Optional[str] = EstimatorPath,
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="Most tokens per answer."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass."),
    on_miss: str = OnMissOpt,
    host_threads: Optional[int] = HostThreads,
    seed: int = Seed,
    threads: Optional[int] = Threads,
) -> None:
    from rich.console import Console

    from moespec.cli.runtime_opts import build_runtime_config, check_estimator_use, enum_option
    from moespec.config import ExecuteMode, Predictor, SamplingConfig

    set_threads(threads)
    out = Console(highlight=False)
    if prompt is not None and not prompt.strip():
        from moespec.errors import PromptError

        raise PromptError("--prompt is empty", "pass some text, e.g. --prompt \"What is 2+2?\"")
    kind = enum_option(Predictor, predictor, "--predictor")
    check_estimator_use(estimator, [kind])
    cfg = build_runtime_config(
        device=device, dtype=dtype, expert_dtype=expert_dtype, gpu_memory=gpu_memory, cache_experts=cache_experts,
        predictor=kind, execute=enum_option(ExecuteMode, execute, "--execute"),
        fetch_threshold=fetch_threshold, link_gbps=link_gbps, calibration=calibration, estimator=estimator,
        on_miss=on_miss, host_threads=host_threads,
    )
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
    session = _open_session(model, cfg, sampling, system, quiet=json_out)
    try:
        if prompt is not None:
            _one_shot(session, prompt, json_out, out)
        else:
            _repl(session, out)
    finally:
        session.engine.om.close()


def _open_session(model, cfg, sampling, system, quiet: bool):
    from transformers import AutoTokenizer

    from moespec.chat.session import ChatSession
    from moespec.hub.resolve import resolve_model
    from moespec.runtime.engine import Engine
    from moespec.runtime.offload import load_offloaded
    from moespec.runtime.stats import StatsRecorder

    if model is None:
        try:
            from moespec.default_model import ensure_default_model
        except ImportError:
            from moespec.errors import ModelNotFoundError

            raise ModelNotFoundError("this build has no embedded default model",
                                     "pass MODEL: a local folder or a Hub id (`moespec download MODEL`)") from None
        path = ensure_default_model(None if quiet else err_console)
    else:
        path = resolve_model(model)
    om = load_offloaded(path, cfg, StatsRecorder())
    # Why: stats must come from synchronised clocks; the recorder syncs through the transfer engine.
    om.recorder.synchronize = om.cache.engine.synchronize
    tokenizer = AutoTokenizer.from_pretrained(path)
    if not quiet:
        err_console.print(
            f"[dim]{path.name}: {len(om.store.moe_layers)} MoE layers × {om.store.num_experts} experts "
            f"(top-{om.adapter.top_k()}), {om.cache.num_slots} cache slots of {om.store.expert_bytes / 1e6:.2f} MB "
            f"on {om.device}; predictor {cfg.predictor.value}, execute {cfg.execute.value}[/]")
    return ChatSession(Engine(om), tokenizer, sampling, system)


def _one_shot(session, prompt: str, json_out: bool, out) -> None:
    if json_out:
        text = "".join(session.send(prompt))
        print(json.dumps({"text": text, "stats": asdict(session.last.summary)}))
        return
    for piece in session.send(prompt):
        out.print(piece, end="", soft_wrap=True)
    out.print()
    err_console.print(f"[dim]{session.last.summary.footer()}[/]")


def _repl(session, out) -> None:
    from moespec.errors import PromptError

    err_console.print("[dim]/reset clears the history · /stats shows per-layer stats · /exit quits[/]")
    while True:
        out.print("[bold]>[/] ", end="")
        line = sys.stdin.readline()
        if not line:  # EOF
            out.print()
            return
        line = line.strip()
        if line in ("/exit", "/quit"):
            return
        if line == "/reset":
            session.reset()
            out.print("[dim]history cleared[/]")
            continue
        if line == "/stats":
            _print_stats(session, out)
            continue
        if not line:
            continue
        try:
            for piece in session.send(line):
                out.print(piece, end="", soft_wrap=True)
        except PromptError as exc:
            err_console.print(f"[red]error:[/] {exc.message}" + (f"\n[yellow]hint:[/] {exc.hint}" if exc.hint else ""))
            continue
        out.print()
        err_console.print(f"[dim]{session.last.summary.footer()}[/]")


def _print_stats(session, out) -> None:
    from rich.table import Table

    from moespec.runtime.stats import LayerStats

    steps = [s for s in session.engine.om.recorder.steps if s.kind == "decode"]
    if not steps:
        out.print("[dim]no answer yet[/]")
        return
    per_layer: dict[int, LayerStats] = {}
    for s in steps:
        for layer, st in s.layers.items():
            per_layer.setdefault(layer, LayerStats()).add(st)
    n = len(steps)
    table = Table(title=f"last answer: {n} decode tokens, per layer and token")
    for col in ("layer", "hits", "misses", "prefetched", "wasted", "recall@K", "H2D MB", "stall ms", "compute ms"):
        table.add_column(col, justify="right")
    for layer in sorted(per_layer):
        st = per_layer[layer]
        rec = f"{st.recall_hits / st.recall_total:.2f}" if st.recall_total else "-"
        table.add_row(str(layer), f"{st.hits / n:.2f}", f"{st.misses / n:.2f}", f"{st.prefetched / n:.2f}",
                      f"{st.prefetch_wasted / n:.2f}", rec, f"{st.h2d_bytes / n / 1e6:.3f}",
                      f"{st.stall_ms / n:.2f}", f"{st.compute_ms / n:.2f}")
    out.print(table)
