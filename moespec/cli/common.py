"""What every command shares: the error boundary and the runtime options (defined once)."""

from __future__ import annotations

import functools
import os
from typing import Callable, Optional, TypeVar

import typer
from rich.console import Console

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
            err_console.print(f"[bold red]error:[/] {exc.message}", highlight=False, soft_wrap=True)
            if exc.hint:
                err_console.print(f"[yellow]hint:[/] {exc.hint}", highlight=False, soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            err_console.print("interrupted; nothing partial was written")
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


# Options shared by chat, calibrate, profile and train-estimator: defined once, reused.
GpuMemory = typer.Option(None, "--gpu-memory", help="Device bytes for the expert cache, e.g. 2GiB.")
CacheExperts = typer.Option(None, "--cache-experts", help="Number of expert slots in the device cache.")
Device = typer.Option("auto", "--device", help="cpu, cuda or cuda:N; auto picks cuda when present.")
Dtype = typer.Option("auto", "--dtype", help="auto (the checkpoint's), float32, bfloat16 or float16.")
ExpertDtype = typer.Option("auto", "--expert-dtype",
                           help="auto keeps packed experts (GPT-OSS MXFP4) packed in host memory and dequantises "
                                "them on the device after each copy; bf16 (= --dtype) dequantises once at load.")
LinkGbps = typer.Option(None, "--link-gbps", help="Emulated host-to-device link in GB/s (CPU only).")
FetchThreshold = typer.Option(0.1, "--fetch-threshold", help="guarded mode: fetch a miss whose weight >= this.")
Seed = typer.Option(0, "--seed", help="Random seed.")
OnMissOpt = typer.Option("fetch", "--on-miss",
                         help="Where a cache miss runs: fetch (copy it to the device), host (compute it on "
                              "the host from its row; only its output moves) or auto (per miss, from "
                              "measured link and compute costs).")
HostThreads = typer.Option(None, "--host-threads",
                           help="Worker threads computing misses on the host (--on-miss host/auto); "
                                "default: from the free cores (CUDA keeps two for the launcher).")
ModelArg = typer.Argument(None, help="Local folder or Hub id in the local cache; default: the embedded model.")
Data = typer.Option(None, "--data", help="A .txt file, a folder of .txt, or a .jsonl with a \"text\" field.")
HeldoutTokens = typer.Option(None, "--heldout-tokens", help="Held-out tokens for recall; default tokens/10.")
SeqLen = typer.Option(512, "--seq-len", help="Tokens per chunk (one prefill pass each).")
EstimatorPath = typer.Option(None, "--estimator",
                             help="Estimator file for --predictor estimator / hybrid (default: the one "
                                  "`moespec train-estimator` wrote for MODEL).")
PredictorOpt = typer.Option("router", "--predictor", help="none, router, quasi, estimator or hybrid.")
ExecuteOpt = typer.Option("exact", "--execute", help="exact, speculative or guarded.")
CalibrationPath = typer.Option(None, "--calibration",
                               help="Calibration file for --predictor quasi (default: found automatically).")
Threads = typer.Option(None, "--threads",
                       help="CPU threads for torch (default: torch's choice; 1 is faster when other work "
                            "shares the cores).")


def set_threads(threads: Optional[int]) -> None:
    """Apply ``--threads`` to torch (None keeps torch's choice).

    Raises:
        OptionError: fewer than 1 thread.
    """
    if threads is None:
        return
    if threads < 1:
        from moespec.errors import OptionError

        raise OptionError(f"--threads {threads} must be at least 1")
    import torch

    torch.set_num_threads(threads)


def optional_str(value: Optional[str]) -> Optional[str]:
    """Typer passes "" for some empty options; treat it as unset."""
    return value or None
