"""`moespec train-estimator`: distil per-layer router estimators and make the hybrid choice."""

from __future__ import annotations

import math
from typing import Optional

import typer

from moespec.cli.common import (CacheExperts, Data, Device, Dtype, ExpertDtype, Flag, GpuMemory, GroupSize, HeldoutTokens,
                                ModelArg, Seed, SeqLen, Threads, err_console, handles_errors, register_command,
                                set_threads)

HELP = """Train small router estimators for MODEL and choose, per layer, which predictor `hybrid` uses.

Text runs through the model (exact mode, experts streamed through the cache; each training pass stops at the router of the last layer it needs); for every served layer the state q (the quasi-hidden state with a calibration file, else the normalised residual) and the next layer's true router logits are written to disk in shards. Each estimator (down-projection H -> H/m, layer embedding, SiLU MLP with a residual, norm, head -> E) is distilled with KL to the true router's softmax, stopping early on held-out recall@K. Per layer, `hybrid` uses the estimator only where its held-out recall beats router and quasi by more than --margin and the copies it saves (at --link-gbps) outweigh its measured cost per token. `moespec chat MODEL --predictor hybrid` (or `estimator`) finds the file automatically; `--estimator FILE` picks another one.

--layers auto serves the layers whose best parameter-free recall (from `moespec calibrate`, else measured) is below --auto-below, at most --max-layers of them.

Examples:

  moespec train-estimator --tokens 200000

  moespec train-estimator Qwen/Qwen3-30B-A3B --gpu-memory 8GiB --tokens 4000000 --layers 0,1,2

  moespec train-estimator ./my-moe --data corpus.jsonl --keep-states && moespec train-estimator ./my-moe --reuse-states --shared
"""


DEFAULT_TOKENS = 500_000  # more than the shipped text holds: by default all of it is used, without a note


def register(app: typer.Typer) -> None:
    """Add the `train-estimator` command to ``app``."""
    register_command(app, "train-estimator", HELP, train_estimator)


@handles_errors
def train_estimator(
    model: Optional[str] = ModelArg,
    data: Optional[str] = Data,
    tokens: Optional[int] = typer.Option(None, "--tokens", show_default=False,
                                         help="Training tokens (default: 500,000, or all the data holds if fewer)."),
    heldout_tokens: Optional[int] = HeldoutTokens,
    seq_len: int = SeqLen,
    layers: str = typer.Option("auto", "--layers", help="auto, or served MoE layers such as 0,1,5."),
    max_layers: int = typer.Option(8, "--max-layers", help="auto: serve at most this many layers."),
    auto_below: float = typer.Option(0.9, "--auto-below", help="auto: serve layers whose best router/quasi recall is below this."),
    input_: str = typer.Option("auto", "--input", help="Estimator input: auto (quasi with a calibration file), quasi or router."),
    down: int = typer.Option(8, "--down", help="m: bottleneck H/m (8 matched 2 and 4 on the default model at a fraction of the cost)."),
    expand: int = typer.Option(2, "--expand", help="n: MLP width n*H/m."),
    shared: bool = typer.Option(False, "--shared/--per-layer", metavar="", help="One network for all served layers, or one per layer."),
    epochs: int = typer.Option(8, "--epochs", help="Passes over the training states (early stopping may end sooner)."),
    batch: int = typer.Option(512, "--batch", help="Tokens per step and layer."),
    lr: float = typer.Option(3e-3, "--lr", help="Peak AdamW learning rate (cosine schedule)."),
    margin: float = typer.Option(0.02, "--margin", help="Recall the estimator must gain over router/quasi to be chosen."),
    link_gbps: float = typer.Option(25.0, "--link-gbps", help="Host-to-device GB/s that saved copies are valued at; 0 ignores the estimator's cost."),
    calibration: Optional[str] = typer.Option(None, "--calibration", help="Calibration file (default: found automatically)."),
    states_dir: Optional[str] = typer.Option(None, "--states-dir", help="Where the collected states go (default: under moespec's home)."),
    reuse_states: bool = Flag("--reuse-states", help="Train on states collected before (and keep them)."),
    keep_states: bool = Flag("--keep-states", help="Keep the collected states for --reuse-states."),
    out: Optional[str] = typer.Option(None, "--out", help="Estimator file to write; default: where chat looks for it."),
    gpu_memory: Optional[str] = GpuMemory,
    cache_experts: Optional[int] = CacheExperts,
    device: str = Device,
    dtype: str = Dtype,
    expert_dtype: str = ExpertDtype,
    group_size: Optional[int] = GroupSize,
    threads: Optional[int] = Threads,
    seed: int = Seed,
) -> None:
    import shutil
    from pathlib import Path

    from moespec.calibrate.data import load_text_source
    from moespec.predict.calibration_file import ensure_writable
    from moespec.cli.runtime_opts import build_runtime_config
    from moespec.config import ExecuteMode, Predictor
    from moespec.estimator.states import read_manifest
    from moespec.artifacts import default_estimator_path
    from moespec.estimator.hybrid import HybridConfig
    from moespec.estimator.run import EstimatorConfig
    from moespec.estimator.train import TrainConfig

    asked = tokens is not None or heldout_tokens is not None  # a note on fewer tokens only when some were asked for
    cfg = EstimatorConfig(
        tokens=DEFAULT_TOKENS if tokens is None else tokens, heldout_tokens=heldout_tokens, seq_len=seq_len, layers=_parse_layers(layers),
        auto_below=auto_below, max_layers=max_layers, input=input_, down=down, expand=expand, shared=shared,
        train=TrainConfig(epochs=epochs, batch_tokens=batch, lr=lr, seed=seed),
        hybrid=HybridConfig(margin=margin, link_gbps=link_gbps or None), seed=seed)
    _check_numbers(cfg)
    set_threads(threads)
    rcfg = build_runtime_config(device=device, dtype=dtype, gpu_memory=gpu_memory, cache_experts=cache_experts,
                                predictor=Predictor.NONE, execute=ExecuteMode.EXACT, fetch_threshold=0.0,
                                link_gbps=None, expert_dtype=expert_dtype, group_size=group_size)
    source = load_text_source(data, seed)  # bad data fails before the model loads
    path = _resolve(model)
    if calibration:  # a missing --calibration file: said before the model loads
        from moespec.artifacts import find_calibration

        find_calibration(path, calibration)
    target = ensure_writable(Path(out) if out else default_estimator_path(path))
    folder = Path(states_dir).expanduser() if states_dir else _default_states_dir(path)
    plan = None
    if not (reuse_states and read_manifest(folder) is not None):
        plan = _plan(path, source, cfg, asked, rcfg.dtype)
    try:
        _train(path, rcfg, cfg, calibration, plan, folder, reuse_states, source, target, keep_states)
    finally:  # Ctrl-C or an error included: states nobody asked to keep never stay behind
        if not (keep_states or reuse_states):
            shutil.rmtree(folder, ignore_errors=True)


def _train(path, rcfg, cfg, calibration, plan, folder, reuse_states: bool, source, target, keep_states: bool) -> None:
    """Load the model, collect (or reuse) the states, train, write the file and show the result."""
    import time

    from moespec.estimator.run import find_model_calibration, fit, input_kind, prepare_states
    from moespec.predict.estimator_file import save_estimator
    from moespec.default_model.checked import load_checked

    om, note = load_checked(path, rcfg)  # the default model's weights: checked by their bytes
    if note:
        err_console.print(f"[dim]{note}[/]", highlight=False)
    try:
        if cfg.seq_len > om.max_context():
            from moespec.errors import OptionError

            raise OptionError(f"--seq-len {cfg.seq_len} exceeds the model's context of {om.max_context()} tokens",
                              f"use --seq-len {min(512, om.max_context())}")
        calib = find_model_calibration(om, calibration)
        kind = input_kind(cfg.input, calib)
        t0 = time.perf_counter()
        served, note = _served_layers(om, cfg, calib, plan, folder, reuse_states)
        err_console.print(f"[dim]{path.name}: {len(om.store.moe_layers)} MoE layers × {om.store.num_experts} experts "
                          f"(top-{om.adapter.top_k()}) on {om.device}; serving layers {','.join(map(str, served))} "
                          f"({note}); estimator input: {kind}[/]", highlight=False, soft_wrap=True)
        with _Bars() as bars:
            manifest, reused = prepare_states(om, plan, served, kind, calib, folder, reuse_states,
                                              source.description, cfg.seq_len, bars.collect)
            t1 = time.perf_counter()
            outcome = fit(om, folder, manifest, cfg, calib, bars.train)
        t2 = time.perf_counter()
    finally:
        om.close()
    save_estimator(target, outcome.file)
    _render(outcome, reused, t1 - t0, t2 - t1, target, folder if (keep_states or reuse_states) else None)


def _parse_layers(text: str) -> tuple[int, ...] | None:
    from moespec.errors import OptionError

    if text.strip() == "auto":
        return None
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise OptionError(f"--layers {text!r} is not a list of layer numbers", "write it like 0,1,5 or auto") from None


def _check_numbers(cfg) -> None:
    from moespec.errors import OptionError

    for flag, value in (("--down", cfg.down), ("--expand", cfg.expand), ("--epochs", cfg.train.epochs),
                        ("--batch", cfg.train.batch_tokens), ("--max-layers", cfg.max_layers)):
        if value < 1:
            raise OptionError(f"{flag} {value} must be at least 1")
    if cfg.train.lr <= 0:
        raise OptionError(f"--lr {cfg.train.lr} must be positive")
    if cfg.hybrid.link_gbps is not None and cfg.hybrid.link_gbps < 0:
        raise OptionError(f"--link-gbps {cfg.hybrid.link_gbps} must be >= 0 (0 ignores the estimator's cost)")


def _resolve(model: Optional[str]):
    """MODEL's folder (None or the default model named: built on first use, or again after a failed check)."""
    from moespec.default_model.checked import resolve

    return resolve(model, err_console)


def _default_states_dir(path):
    from moespec.artifacts import model_key, sanitize_model_id
    from moespec.paths import moespec_home

    return moespec_home() / "estimator-states" / sanitize_model_id(model_key(path))


def _plan(path, source, cfg, asked: bool, dtype: str = "auto"):
    from moespec.calibrate.data import plan_chunks
    from moespec.model_check import load_tokenizer

    tokenizer = load_tokenizer(path, dtype)
    plan = plan_chunks(tokenizer, source, cfg.tokens, cfg.heldout_tokens, cfg.seq_len)
    for note in plan.notes if asked else ():
        err_console.print(f"[yellow]note:[/] {note}", highlight=False)
    return plan


def _served_layers(om, cfg, calib, plan, folder, reuse: bool) -> tuple[list[int], str]:
    from moespec.estimator.states import read_manifest
    from moespec.estimator.run import auto_layers, check_layers

    if cfg.layers is not None:
        return check_layers(om, cfg.layers), "--layers"
    if reuse:
        have = read_manifest(folder)
        if have is not None:
            return list(have.layers), f"auto: the layers of the states in {folder}"
    served, best, source = auto_layers(om, calib, plan.heldout, cfg)
    worst = ", ".join(f"{layer}: {best[layer]:.2f}" for layer in served)
    return served, f"auto from the {source}; best parameter-free recall {worst}"


class _Bars:
    """Progress bars: collection (tokens), held-out collection, then training (steps, loss, recall).

    A 20-column bar and short texts keep each line within 80 columns, so no number is cut.
    """

    def __init__(self, console=None) -> None:
        self.console = console or err_console

    def __enter__(self):
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

        columns = (TextColumn("{task.description}"), BarColumn(bar_width=20), TaskProgressColumn(),
                   TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
        self.bar = Progress(*columns, console=self.console, transient=False)
        self.bar.__enter__()
        self.tasks: dict[str, int] = {}
        self.recall = float("nan")
        return self

    def __exit__(self, *exc):
        return self.bar.__exit__(*exc)

    def _task(self, key: str, label: str, total: int) -> int:
        if key not in self.tasks:
            self.tasks[key] = self.bar.add_task(label, total=total, info="")
        return self.tasks[key]

    def collect(self, stage: str, done: int, total: int) -> None:
        label = {"collect": "collecting states", "heldout": "held-out states"}.get(stage, stage)
        task = self._task(stage, label, total)
        self.bar.update(task, completed=done, info=f"{done:,}/{total:,} tok")

    def train(self, step: int, total: int, loss: float, recall: float) -> None:
        task = self._task("train", "training", total)
        if not math.isnan(recall):
            self.recall = recall
        rec = "" if math.isnan(self.recall) else f" · recall {self.recall:.3f}"  # held-out recall@K
        self.bar.update(task, completed=step, total=total, info=f"KL {loss:.4f}{rec}")


def _render(outcome, reused: bool, collect_s: float, train_s: float, target, kept) -> None:
    from rich.console import Console

    from moespec.tables import Column, fit_tables

    out = Console()
    ef, result, man = outcome.file, outcome.result, outcome.manifest
    k = man.top_k
    layers = man.moe_layers[:-1]
    nxt = dict(zip(man.moe_layers, man.moe_layers[1:]))

    def col(header: str, metric: str, name: str) -> Column:
        values = [ef.metric(metric, name, layer) for layer in layers]
        return Column(header, ["-" if math.isnan(v) else f"{v:.3f}" for v in values])

    chosen_at = [ef.choice.get(layer, "router") for layer in layers]
    key = [Column("layer", [str(layer) for layer in layers]), Column("→", [str(nxt[layer]) for layer in layers])]
    cols = [col("router", "recall", "router"), col("quasi", "recall", "quasi"), col("estim-\nator", "recall", "estimator"),
            Column("chosen", [f"[bold]{c}[/]" if c == "estimator" else c for c in chosen_at]),
            Column("params", [f"{ef.bank.num_parameters(layer):,}" if layer in ef.layers else "-" for layer in layers]),
            col("cost ms\nrouter", "cost_ms", "router"), col("cost ms\nestimator", "cost_ms", "estimator")]
    title = f"held-out recall@{k} predicting the next MoE layer ({man.heldout_tokens:,} tokens)"
    for table in fit_tables(title, key, cols, out.width):
        out.print(table)
    out.print(f"[dim]cost: ms per decode token on {ef.meta['cost_device']}[/]")
    chosen = [layer for layer, c in ef.choice.items() if c == "estimator"]
    out.print(f"hybrid uses estimators at layers {','.join(map(str, chosen)) or 'none'} "
              f"(margin {ef.meta['margin']}, copies valued at {ef.meta['link_gbps'] or 'no'} GB/s)", soft_wrap=True)
    stop = "early stop" if result.stopped_early else "all epochs"
    states = "reused states" if reused else "collection"
    out.print(f"{man.tokens:,} training + {man.heldout_tokens:,} held-out tokens; {states} {collect_s:.1f} s, "
              f"training {train_s:.1f} s ({result.steps:,} steps, {stop}); "
              f"{ef.bank.num_parameters():,} estimator parameters", soft_wrap=True)
    if kept is not None:
        out.print(f"states kept in {kept} (train again with --reuse-states)", soft_wrap=True)
    out.print(f"wrote {target}", soft_wrap=True)
