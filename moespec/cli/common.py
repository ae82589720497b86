"""What every command shares: the error boundary and the runtime options (defined once)."""

from __future__ import annotations

import functools
import inspect
import os
import sys
from typing import Any, Callable, Optional, TypeVar

import typer
from rich.console import Console
from typer.core import TyperGroup
from rich.markup import escape

from moespec.config import DEFAULT_FETCH_THRESHOLD, GuardRule
from moespec.errors import MoespecError

F = TypeVar("F", bound=Callable)

err_console = Console(stderr=True)


def handles_errors(fn: F) -> F:
    """Turn MoespecError into a red message + hint and exit code 2; Ctrl-C into exit 130.

    ``MOESPEC_DEBUG=1`` re-raises so the traceback shows.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except MoespecError as exc:
            if os.environ.get("MOESPEC_DEBUG"):
                raise
            print_error(exc)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            err_console.print("interrupted; nothing partial was written")
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


def print_error(exc: MoespecError) -> None:
    """The error line (and its hint line) of a MoespecError, on stderr."""
    # escape: messages hold paths and pip specs like moespec[plot], which are not markup
    err_console.print(f"[bold red]error:[/] {escape(exc.message)}", highlight=False, soft_wrap=True)
    if exc.hint:
        err_console.print(f"[yellow]hint:[/] {escape(exc.hint)}", highlight=False, soft_wrap=True)


class MoespecGroup(TyperGroup):
    """The `moespec` command group: a value of the wrong type for an option (``--threads abc``) is one
    error line naming the flag and its range (cli/ranges.py), like every other bad value, instead of
    Click's usage box."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except typer.BadParameter as exc:
            if os.environ.get("MOESPEC_DEBUG"):
                raise
            from moespec.cli.ranges import range_of

            opts = getattr(exc.param, "opts", None) or [exc.param_hint or "an option"]
            flag = max(opts, key=len)
            spec = range_of(ctx.invoked_subcommand or "", flag)
            allowed = f"; it must be {spec.text()}" if spec is not None else ""
            why = exc.message.rstrip(".")
            print_error(MoespecError(f"{flag}: {why[:1].lower()}{why[1:]}{allowed}",
                                     f"see `moespec {ctx.invoked_subcommand} --help`" if ctx.invoked_subcommand else ""))
            raise typer.Exit(2) from None


def Flag(*decls: str, help: str) -> Any:  # noqa: N802 (reads like typer.Option)
    """A boolean option shown as a flag in --help (``--json``, not ``--json <bool>``).

    ``metavar=""`` is typer's public way to set the type column; a flag takes no value, so it is empty.
    """
    return typer.Option(False, *decls, help=help, metavar="")


def _show_help(ctx: typer.Context, value: bool) -> None:
    if value:
        typer.echo(ctx.get_help())
        raise typer.Exit()


# typer's own --help shows "<bool>"; this one is the same flag without the type column.
HelpFlag = typer.Option(False, "--help", "-h", metavar="", is_eager=True, expose_value=False, callback=_show_help,
                        help="Show this message and exit.")


def reflow(text: str) -> str:
    """Join the lines of each paragraph of a help text, so Rich wraps it to the terminal's width.

    typer's rich mode keeps single line breaks, so source-wrapped help broke lines twice at 80
    columns. A paragraph's leading indent (examples) is kept.
    """
    paragraphs = []
    for para in text.strip("\n").split("\n\n"):
        lines = para.split("\n")
        indent = lines[0][: len(lines[0]) - len(lines[0].lstrip())]
        paragraphs.append(indent + " ".join(line.strip() for line in lines if line.strip()))
    return "\n\n".join(paragraphs) + "\n"


def register_command(app: typer.Typer, name: str, help: str, fn: Callable) -> None:
    """Add ``fn`` to ``app`` as command ``name``, with a --help flag that renders like our other flags.

    The callback gets one more keyword parameter (the --help flag; typer fills it with its default,
    which is dropped here), and checks every numeric option against its range (cli/ranges.py)
    before ``fn`` runs; everything else about ``fn`` is unchanged.
    """

    from moespec.cli.ranges import check_options, range_of

    sig = inspect.signature(fn)
    numeric = {}  # parameter -> flag, for every option with a range (cli/ranges.py)
    for param in sig.parameters.values():
        long = [d.split("/")[0] for d in getattr(param.default, "param_decls", None) or () if d.startswith("--")]
        if long and range_of(name, long[0]) is not None:
            numeric[param.name] = long[0]

    @functools.wraps(fn)
    def command(*args, **kwargs):
        kwargs.pop("help_", None)
        try:  # every numeric option in range before the command body runs (no model loads first)
            check_options(name, {flag: kwargs.get(param) for param, flag in numeric.items()})
        except MoespecError as exc:
            if os.environ.get("MOESPEC_DEBUG"):
                raise
            print_error(exc)
            raise typer.Exit(exc.exit_code) from None
        return fn(*args, **kwargs)

    help = reflow(help)
    extra = inspect.Parameter("help_", inspect.Parameter.KEYWORD_ONLY, default=HelpFlag, annotation=bool)
    command.__signature__ = sig.replace(parameters=[*sig.parameters.values(), extra])  # type: ignore[attr-defined]
    app.command(name, help=help, add_help_option=False)(command)


# Options shared by chat, calibrate, profile and train-estimator: defined once, reused.
GpuMemory = typer.Option(None, "--gpu-memory", help="Device bytes for the expert cache, e.g. 2GiB.")
HostMemory = typer.Option(None, "--host-memory",
                          help="RAM for expert rows read from disk, e.g. 8GiB (experts stay on disk; CPU).")
CacheExperts = typer.Option(None, "--cache-experts", help="Number of expert slots in the device cache.")
Device = typer.Option("auto", "--device", help="cpu, cuda or cuda:N; auto picks cuda when present.")
Dtype = typer.Option("auto", "--dtype", help="auto (the checkpoint's), float32, bfloat16 or float16.")
ExpertDtype = typer.Option("auto", "--expert-dtype",
                           help="auto keeps the checkpoint's experts (GPT-OSS MXFP4 stays packed); int8 / int4 "
                                "quantises them group-wise at load (~0.26x / ~0.14x the float32 bytes, cached "
                                "for the next start); experts move packed and are dequantised after each copy, "
                                "or computed packed by the CPU kernels. w8a8 / w4a8: the same rows, and the "
                                "CPU kernels quantise activations to int8 too (faster, not exact). A float "
                                "dtype (= --dtype) dequantises MXFP4 once at load.")
Requantize = Flag("--requantize",
                  help="With --expert-dtype int8/int4 on a GGUF whose experts are already quantised: "
                               "dequantise and quantise them again (without it that is refused).")
GroupSize = typer.Option(None, "--group-size",
                         help="int8/int4: columns of a weight row per scale and zero point: 32, 64 "
                              "(default), 128 or 256.")
LinkGbps = typer.Option(None, "--link-gbps", help="Emulated host-to-device link in GB/s (CPU only).")
CachePolicyOpt = typer.Option(
    None, "--cache-policy",
    help="Expert cache eviction: lru, lfu, lfru or static (lfu/lfru/static read the calibration file's expert "
         "frequencies). Default: lfru when the model has a calibration file, else lru.")
FetchThreshold = typer.Option(None, "--fetch-threshold", show_default=False,
                              help=f"guarded mode: τ in renormalised gate weight (default {DEFAULT_FETCH_THRESHOLD:g}); with "
                                   "--guard-rule threshold a miss lighter than τ is skipped, with budget a "
                                   "token skips misses lightest first up to τ of its weight.")
GuardRuleOpt = typer.Option(GuardRule.BUDGET.value, "--guard-rule",
                            help="guarded mode: threshold (skip every miss lighter than τ) or budget (skip "
                                 "misses lightest first while the token's skipped weight stays <= τ).")
Seed = typer.Option(0, "--seed", help="Random seed.")
OnMissOpt = typer.Option("fetch", "--on-miss",
                         help="Where a cache miss runs: fetch (copy it to the device), host (compute it on "
                              "the host from its row; only its output moves) or auto (per miss, from "
                              "measured link and compute costs).")
HostThreads = typer.Option(None, "--host-threads",
                           help="Worker threads computing misses on the host (--on-miss host/auto); "
                                "default: the cores torch's threads leave free (CPU), all but two, at most 8 "
                                "(CUDA: the launcher and the copy pump keep theirs).")
ModelArg = typer.Argument(None, help="Local folder, .gguf file or Hub id in the local cache (REPO:QUANT picks a "
                                           "GGUF quant); default: the embedded model.")
Data = typer.Option(None, "--data", help="A .txt file, a folder of .txt, or a .jsonl with a \"text\" field.")
HeldoutTokens = typer.Option(None, "--heldout-tokens", help="Held-out tokens for recall; default tokens/10.")
SeqLen = typer.Option(512, "--seq-len", help="Tokens per chunk (one prefill pass each).")
EstimatorPath = typer.Option(None, "--estimator",
                             help="Estimator file for --predictor estimator / hybrid (default: the one "
                                  "`moespec train-estimator` wrote for MODEL).")
PredictorOpt = typer.Option("router", "--predictor", help="none, router, quasi, estimator or hybrid.")
ExecuteOpt = typer.Option("exact", "--execute",
                          help="exact, speculative or guarded. exact equals transformers' default experts "
                               "implementation at the same dtype (top-k outputs summed in float32, rounded once; "
                               "experts on the CPU compute in the model dtype, float32 sums in another order (int4 rows at one token: "
                               "activations as 24-bit integers per group, within float32's rounding), "
                               "except with --expert-dtype w8a8/w4a8, whose int8 activations are not exact).")
CalibrationPath = typer.Option(None, "--calibration",
                               help="Calibration file for --predictor quasi (default: found automatically).")
Threads = typer.Option(None, "--threads",
                       help="CPU threads for torch (default: torch's choice; 1 is faster when other work "
                            "shares the cores).")
Threads = typer.Option(None, "--threads", show_default=False,
                       help="CPU threads for torch. Default: one fewer than the cores this process may use, at "
                            "least 1 (1 on 2 cores: median chat TPOT on the default model, idle 2-core machine, "
                            "114 ms vs 144 ms with torch's 2 threads, which compete with the copy worker); "
                            "OMP_NUM_THREADS, when set, wins.")


def print_notes(notes: list[str]) -> None:
    """Print the loader's one-line notes (e.g. a stale calibration file's fallback) on stderr, so
    even ``--json`` output stays only the answer."""
    for note in notes:
        err_console.print(f"note: {note}", style="yellow", highlight=False, markup=False, soft_wrap=True)


def default_threads() -> int | None:
    """torch's intra-op threads when --threads is not given; None keeps torch's choice.

    One fewer than the cores this process may use (at least 1): the expert copy worker thread needs a
    core, and with torch on every core the two fight (measured on the default model, see --threads'
    help). ``OMP_NUM_THREADS``, when set, is the user's choice and torch already follows it.
    """
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores - 1)


def set_threads(threads: Optional[int]) -> None:
    """Apply ``--threads`` to torch (None: ``default_threads()``).

    Raises:
        OptionError: fewer than 1 thread.
    """
    if threads is None:
        threads = default_threads()
        if threads is None:
            return
        if "torch" not in sys.modules:
            # torch reads this when it starts: the default costs no torch import here, so a command
            # can still refuse bad input (a missing calibration file) before torch loads
            os.environ["OMP_NUM_THREADS"] = str(threads)
            return
    if threads < 1:
        from moespec.errors import OptionError

        raise OptionError(f"--threads {threads} must be at least 1")
    import torch

    torch.set_num_threads(threads)


def optional_str(value: Optional[str]) -> Optional[str]:
    """Typer passes "" for some empty options; treat it as unset."""
    return value or None

DenseDtype = typer.Option("auto", "--dense-dtype",
                          help="The dense linears' and lm_head's weights (attention, shared expert, lm_head; "
                               "weight-only, CPU): auto (= --dtype), float32, bf16 (half the float32 bytes read per "
                               "token) or int8 (group-wise, ~0.28x). Exact mode is then exact for the quantised "
                               "model. The float weights stay loaded too (more RAM, not less).")
CompileOpt = typer.Option("auto", "--compile",
                          help="Decode steps' dense parts (attention, norms, lm_head) through torch.compile: "
                               "on, off, or auto (on for CUDA, off on CPU where it decoded slower). Start cost "
                               "on the default model (2-core CPU): +19 s the first start (empty inductor "
                               "cache), +3 s later starts (the cache reused). Equal to eager within 1e-5 in float32; "
                               "in bfloat16 it rounds differently (the text may differ).")
