"""`moespec chat`: interactive or one-shot chat through the offloading runtime."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from typing import Optional

import typer

from moespec.cli.common import CompileOpt, DenseDtype
from moespec.cli.common import (CacheExperts, CachePolicyOpt, CalibrationPath, Device, Dtype, EstimatorPath, ExecuteOpt,
                                ExpertDtype, FetchThreshold, Flag, HostMemory, GpuMemory, GroupSize, GuardRuleOpt, HostThreads,
                                LinkGbps, ModelArg, OnMissOpt, PredictorOpt, Seed, Threads, err_console, handles_errors,
                                print_notes, register_command, Requantize, set_threads)

HELP = """Chat with an MoE model whose experts are offloaded to host memory.

With no MODEL, the embedded default model (a small real MoE built from SmolLM2-135M-Instruct)
is built on first use and then loaded from moespec's cache.

Examples:

  moespec chat --prompt "What is the capital of France?"

  moespec chat ./Qwen3-30B-A3B --gpu-memory 8GiB --predictor router

  moespec chat MODEL --cache-experts 16 --link-gbps 25 --prompt "Hi" --json

  moespec chat MODEL --predictor hybrid --estimator estimators.safetensors

  moespec chat MODEL --cache-experts 8 --on-miss auto --prompt "Hi"

  echo "Summarise this" | moespec chat MODEL --prompt - --json

In the REPL: /help lists the commands; Ctrl-C stops an answer (the part shown
stays in the conversation); Ctrl-C or Ctrl-D at an empty prompt quits.
"""

# REPL commands: name -> what it does (shown by /help and in the banner).
COMMANDS = {
    "/help": "list these commands",
    "/reset": "clear the history and the KV cache",
    "/stats": "per-layer statistics of the last answer",
    "/exit": "quit (also /quit, Ctrl-D, Ctrl-C at an empty prompt)",
}
SYSTEM_HELP = ("System prompt, kept first on every turn. With a chat template that has no system "
               "role, it is prefixed to the first user message.")


def register(app: typer.Typer) -> None:
    """Add the `chat` command to ``app``."""
    register_command(app, "chat", HELP, chat)


@handles_errors
def chat(
    model: Optional[str] = ModelArg,
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p",
                                         help="Answer this once and exit; - reads it from stdin."),
    json_out: bool = Flag("--json", help="With --prompt: print one JSON object (text + stats)."),
    system: Optional[str] = typer.Option(None, "--system", help=SYSTEM_HELP),
    gpu_memory: Optional[str] = GpuMemory,
    cache_experts: Optional[int] = CacheExperts,
    host_memory: Optional[str] = HostMemory,
    predictor: str = PredictorOpt,
    execute: str = ExecuteOpt,
    fetch_threshold: Optional[str] = FetchThreshold,
    guard_rule: str = GuardRuleOpt,
    cache_policy: Optional[str] = CachePolicyOpt,
    device: str = Device,
    dtype: str = Dtype,
    expert_dtype: str = ExpertDtype,
    dense_dtype: str = DenseDtype,
    group_size: Optional[int] = GroupSize,
    requantize: bool = Requantize,
    link_gbps: Optional[float] = LinkGbps,
    calibration: Optional[str] = CalibrationPath,
    estimator: Optional[str] = EstimatorPath,
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="Most tokens per answer."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy; any positive value samples."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass, in (0, 1]."),
    on_miss: str = OnMissOpt,
    host_threads: Optional[int] = HostThreads,
    compile_mode: str = CompileOpt,
    seed: int = Seed,
    threads: Optional[int] = Threads,
) -> None:
    from rich.console import Console

    from moespec.cli.runtime_opts import build_runtime_config, check_estimator_use, enum_option
    from moespec.config import ExecuteMode, Predictor, SamplingConfig

    set_threads(threads)
    out = Console(highlight=False)
    prompt = _read_prompt(prompt, json_out)
    kind = enum_option(Predictor, predictor, "--predictor")
    check_estimator_use(estimator, [kind])
    cfg = build_runtime_config(
        device=device, dtype=dtype, expert_dtype=expert_dtype, group_size=group_size, gpu_memory=gpu_memory, cache_experts=cache_experts, host_memory=host_memory,
        predictor=kind, execute=enum_option(ExecuteMode, execute, "--execute"),
        fetch_threshold=fetch_threshold, link_gbps=link_gbps, calibration=calibration, estimator=estimator,
        cache_policy=cache_policy, on_miss=on_miss, host_threads=host_threads, guard_rule=guard_rule,
        requantize=requantize, compile_mode=compile_mode, dense_dtype=dense_dtype,
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


def _read_prompt(prompt: Optional[str], json_out: bool) -> Optional[str]:
    """The one-shot prompt: ``--prompt TEXT``, or stdin for ``--prompt -``; None for the REPL.

    Raises:
        OptionError: --json without --prompt.
        PromptError: an empty prompt.
    """
    from moespec.errors import OptionError, PromptError

    if prompt is None:
        if json_out:
            raise OptionError("--json needs --prompt (the REPL prints no JSON)",
                              "add --prompt TEXT, or --prompt - to read it from stdin")
        return None
    if prompt == "-":
        prompt = sys.stdin.read().rstrip("\n")
        if not prompt.strip():
            raise PromptError("--prompt - read an empty prompt from stdin", "pipe some text in, e.g. echo hi |")
    if not prompt.strip():
        raise PromptError("--prompt is empty", "pass some text, e.g. --prompt \"What is 2+2?\"")
    return prompt


def _open_session(model, cfg, sampling, system, quiet: bool):
    from moespec.chat.open_model import open_model
    from moespec.cli.runtime_opts import check_predictor_files

    check_predictor_files(model, cfg)  # a missing calibration/estimator file: said in < 1 s, before loading
    from moespec.chat.session import ChatSession

    opened = open_model(model, cfg, None if quiet else err_console)
    print_notes(opened.engine.om.notes)
    if not quiet:
        om = opened.engine.om
        err_console.print(f"[dim]{opened.describe(cfg)}[/]", highlight=False)
        total = len(om.store.moe_layers) * om.store.num_experts
        if om.cache.num_slots >= total:
            from moespec.runtime.load import min_slots

            # Said once: with every expert resident the stats show no offloading, and the user should know why.
            some = max(min_slots(om.adapter.top_k(), cfg.predictor), total // 4)
            err_console.print(f"[dim]all {total} experts fit the cache, none is offloaded; "
                              f"--cache-experts {some} offloads[/]")
    return ChatSession(opened.engine, opened.tokenizer, sampling, system)


def _one_shot(session, prompt: str, json_out: bool, out) -> None:
    if json_out:
        text = "".join(session.send(prompt))
        from moespec.integrity import json_safe

        # JSON has no NaN: a value that is not a number (recall without a prediction) is null
        print(json.dumps(json_safe({"text": text, "stats": asdict(session.last.summary)}), allow_nan=False))
        return
    try:
        for piece in session.send(prompt):
            out.print(piece, end="", soft_wrap=True, markup=False)  # model text is not Rich markup
    except KeyboardInterrupt:
        out.print()  # the error boundary's "interrupted" goes on its own line
        raise
    out.print()
    _note_system_merged(session)
    err_console.print(f"[dim]{_footer(session)}[/]")


def _read_line(reader) -> Optional[str]:
    """One line from ``reader`` (cli/line_editor.py); None at end of input (Ctrl-D) or Ctrl-C at an
    empty prompt. From a pipe, Ctrl-C raises KeyboardInterrupt."""
    return reader.read()


def _repl(session, out) -> None:
    """Read questions until /exit, Ctrl-D or Ctrl-C at the prompt (all exit 0).

    Ctrl-C during an answer stops it, prints a newline and returns to the prompt; the part shown
    stays in the conversation (ChatSession). A line starting with / is a command (/help lists
    them); // sends the rest as text starting with /.
    """
    from rich.markup import escape

    from moespec.cli.line_editor import line_reader, undecodable
    from moespec.errors import MoespecError

    err_console.print("[dim]/help lists the commands · Ctrl-C stops an answer · /exit quits[/]")
    reader = line_reader(out)
    print_notes([reader.note] if reader.note else [])  # a damaged history file, set aside
    while True:
        try:
            line = _read_line(reader)
        except KeyboardInterrupt:
            line = None
        if line is None:  # Ctrl-D / Ctrl-C at the prompt
            out.print()
            return
        line = line.strip()
        if not line:
            continue
        bad = undecodable(line)
        if bad is not None:  # not sent: the model would get lone surrogates, the template fails on them
            err_console.print(f"[red]error:[/] the line is not valid UTF-8 (byte 0x{bad:02x}); nothing was sent",
                              highlight=False)
            continue
        try:
            if line.startswith("/") and not line.startswith("//"):
                if _command(session, line.split()[0], out):
                    return
                continue
            _answer(session, line[1:] if line.startswith("//") else line, out)
        except MoespecError as exc:
            err_console.print(f"[red]error:[/] {escape(exc.message)}"
                              + (f"\n[yellow]hint:[/] {escape(exc.hint)}" if exc.hint else ""),
                              highlight=False, soft_wrap=True)
        except KeyboardInterrupt:  # Ctrl-C outside an answer's tokens (a footer, /stats): back to the prompt
            session.engine.abort()
            out.print()


def _command(session, name: str, out) -> bool:
    """Run REPL command ``name``; True when the REPL should end."""
    from rich.markup import escape

    if name in ("/exit", "/quit"):
        return True
    if name == "/reset":
        session.reset()
        out.print("[dim]history cleared[/]")
    elif name == "/stats":
        _print_stats(session, out)
    elif name == "/help":
        for cmd, what in COMMANDS.items():
            out.print(f"  {cmd:<8} {what}", highlight=False)
        out.print("  //text   send text that starts with /", highlight=False)
        out.print("  Ctrl-C   stop the answer (the part shown stays in the conversation)", highlight=False)
    else:
        err_console.print(f"[red]unknown command[/] {escape(name)}; /help lists the commands", highlight=False)
    return False


def _answer(session, text: str, out) -> None:
    pieces = session.send(text)
    try:
        for piece in pieces:
            out.print(piece, end="", soft_wrap=True, markup=False)  # model text is not Rich markup
    except KeyboardInterrupt:
        _recover(session, pieces)
        out.print()
        last = session.last
        kept = "the part shown stays in the conversation" if last is not None and last.text else "nothing was kept"
        err_console.print(f"[dim]interrupted; {kept}[/]")
        return
    out.print()
    _note_system_merged(session)
    err_console.print(f"[dim]{_footer(session)}[/]")


def _footer(session) -> str:
    """The summary line of the last answer, naming the cache policy (and, unless --on-miss fetch, the
    experts computed on the host per token)."""
    from moespec.chat.footer import footer
    from moespec.config import OnMiss

    om = session.engine.om
    return footer(session.last.summary, policy=om.cache.policy.value, host=om.policy.on_miss != OnMiss.FETCH)


def _recover(session, pieces) -> None:
    """After Ctrl-C: close the answer (it records what was shown) and make the runtime consistent.

    Repeated Ctrl-C while recovering restarts the recovery (Engine.abort is idempotent).
    """
    while True:
        try:
            pieces.close()
            session.engine.abort()
            return
        except KeyboardInterrupt:
            continue


def _note_system_merged(session) -> None:
    if session.system_merged and len(session.history) == 2:  # once, after the first answer
        err_console.print("[dim]note: no system role in this chat template; --system prefixes the first message[/]")


def _print_stats(session, out) -> None:
    """/stats: the last answer's decode stats per MoE layer and token, fitted to ``out``'s width."""
    from moespec.runtime.stats import LayerStats
    from moespec.tables import Column, fit_tables

    steps = [s for s in session.engine.om.recorder.steps if s.kind == "decode"]
    if not steps:
        out.print("[dim]no answer yet[/]")
        return
    per_layer: dict[int, LayerStats] = {}
    for s in steps:
        for layer, st in s.layers.items():
            per_layer.setdefault(layer, LayerStats()).add(st)
    n = len(steps)
    summary = session.last.summary if session.last else None
    if summary is not None:
        whole = summary.prompt_tokens + summary.reused_tokens
        out.print(f"prompt: {whole} tokens, {summary.reused_tokens} reused from the KV cache, "
                  f"{summary.prompt_tokens} prefilled", highlight=False)
    if summary is not None and summary.disk:  # the experts are on disk: the RAM tier is the cache
        d, gbps = summary.disk, summary.disk["disk_read_gbps"]
        out.print(f"disk: {d['disk_mb_per_token']:.2f} MB/token, RAM-tier hit rate {d['ram_tier_hit_rate']:.2f}, "
                  f"stall {d['disk_stall_ms_per_token']:.1f} ms/token, "
                  f"{'-' if gbps is None else f'{gbps:.2f}'} GB/s", highlight=False)
    stats = [per_layer[layer] for layer in sorted(per_layer)]

    def col(header: str, value, fmt: str = ".2f") -> Column:
        return Column(header, [format(value(st), fmt) if value(st) is not None else "-" for st in stats])

    key = [Column("layer", [str(layer) for layer in sorted(per_layer)])]
    cols = [col("hits", lambda st: st.hits / n), col("misses", lambda st: st.misses / n),
            col("pre-\nfetched", lambda st: st.prefetched / n), col("wasted", lambda st: st.prefetch_wasted / n),
            col("recall\n@K", lambda st: st.recall_hits / st.recall_total if st.recall_total else None),
            col("H2D\nMB", lambda st: st.h2d_bytes / n / 1e6, ".3f"), col("stall\nms", lambda st: st.stall_ms / n),
            col("compute\nms", lambda st: st.compute_ms / n)]
    policy = session.engine.om.cache.policy.value
    title = f"last answer: {n} decode tokens, per layer and token (cache policy {policy})"
    for table in fit_tables(title, key, cols, out.width):
        out.print(table)
