"""`moespec serve`: an OpenAI-compatible HTTP server over the offloading runtime."""

from __future__ import annotations

from typing import Optional

import typer

from moespec.cli.common import CompileOpt, DenseDtype
from moespec.cli.common import (CacheExperts, CachePolicyOpt, CalibrationPath, Device, Dtype, EstimatorPath, ExecuteOpt,
                                ExpertDtype, FetchThreshold, HostMemory, GpuMemory, GroupSize, GuardRuleOpt, HostThreads, LinkGbps,
                                ModelArg, Requantize,
                                OnMissOpt, PredictorOpt, Seed, Threads, err_console, handles_errors, register_command,
                                print_notes, set_threads)
from moespec.errors import MoespecError

HELP = """Serve an MoE model through an OpenAI-compatible HTTP API.

One model, one generation at a time; other requests wait in a FIFO queue
(past --max-queue: HTTP 429). GET /metrics shows requests, TTFT/TPOT and,
per layer, expert-cache hit rate, recall@K, stall, H2D bytes, wasted
prefetches and cache occupancy.

Examples:

  moespec serve

  moespec serve ./Qwen3-30B-A3B --gpu-memory 8GiB --port 8080

  moespec serve MODEL --host 0.0.0.0 --api-key "$KEY"

From Python (pip install openai):

  from openai import OpenAI

  c = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")

  r = c.chat.completions.create(model=c.models.list().data[0].id,
      messages=[{"role": "user", "content": "Hi"}], max_tokens=64)

  print(r.choices[0].message.content)

Tools (tools=[...], tool_choice), JSON output (response_format), logprobs,
n, logit_bias and penalties work as in OpenAI's API: see the README.

Listening on anything but loopback requires --api-key (or MOESPEC_API_KEY).
"""


class ServeExtraMissing(MoespecError):
    """`moespec serve` needs packages of the `serve` extra that are not installed."""


def _require_serve_extra() -> None:
    """Raises ServeExtraMissing naming the missing package and the install command."""
    import importlib.util

    for module, package in (("fastapi", "fastapi"), ("uvicorn", "uvicorn"), ("prometheus_client", "prometheus-client"),
                            ("llguidance", "llguidance")):
        if importlib.util.find_spec(module) is None:
            raise ServeExtraMissing(f"`moespec serve` needs {package}, which is not installed",
                                    "pip install 'moespec[serve]'")


def register(app: typer.Typer) -> None:
    """Add the `serve` command to ``app``."""
    register_command(app, "serve", HELP, serve)


@handles_errors
def serve(
    model: Optional[str] = ModelArg,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", help="TCP port."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="MOESPEC_API_KEY",
                                          help="Bearer key clients must send (required off loopback)."),
    max_queue: int = typer.Option(16, "--max-queue", help="Requests that may wait while one generates."),
    max_body_bytes: int = typer.Option(1 << 20, "--max-body-bytes", help="Largest request body."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens",
                                       help="New tokens when a request sets no max_tokens."),
    max_n: int = typer.Option(8, "--max-n", help="Most choices (n) one request may ask for."),
    cors_origin: Optional[list[str]] = typer.Option(None, "--cors-origin", metavar="ORIGIN",
                                                    help="Origin a browser page may call from (repeatable; "
                                                         "'*' for any)."),
    gpu_memory: Optional[str] = GpuMemory,
    cache_experts: Optional[int] = CacheExperts,
    host_memory: Optional[str] = HostMemory,
    predictor: str = PredictorOpt,
    execute: str = ExecuteOpt,
    fetch_threshold: Optional[str] = FetchThreshold,
    guard_rule: str = GuardRuleOpt,
    device: str = Device,
    dtype: str = Dtype,
    expert_dtype: str = ExpertDtype,
    dense_dtype: str = DenseDtype,
    group_size: Optional[int] = GroupSize,
    requantize: bool = Requantize,
    cache_policy: Optional[str] = CachePolicyOpt,
    on_miss: str = OnMissOpt,
    host_threads: Optional[int] = HostThreads,
    compile_mode: str = CompileOpt,
    link_gbps: Optional[float] = LinkGbps,
    calibration: Optional[str] = CalibrationPath,
    estimator: Optional[str] = EstimatorPath,
    seed: int = Seed,
    threads: Optional[int] = Threads,
) -> None:
    _require_serve_extra()
    from moespec.cli.runtime_opts import build_runtime_config, check_estimator_use, enum_option
    from moespec.config import ExecuteMode, Predictor
    from moespec.serve.app import ServeSettings
    from moespec.serve.security import is_loopback

    if not is_loopback(host) and not api_key:
        from moespec.errors import OptionError

        raise OptionError(f"--host {host} is reachable from other machines but no API key is set",
                          "pass --api-key KEY (or set MOESPEC_API_KEY), or keep --host 127.0.0.1")
    set_threads(threads)
    kind = enum_option(Predictor, predictor, "--predictor")
    check_estimator_use(estimator, [kind])
    cfg = build_runtime_config(
        device=device, dtype=dtype, expert_dtype=expert_dtype, gpu_memory=gpu_memory, cache_experts=cache_experts, host_memory=host_memory,
        predictor=kind, execute=enum_option(ExecuteMode, execute, "--execute"),
        fetch_threshold=fetch_threshold, link_gbps=link_gbps, calibration=calibration, estimator=estimator,
        group_size=group_size, cache_policy=cache_policy, on_miss=on_miss, host_threads=host_threads,
        guard_rule=guard_rule,
        requantize=requantize, compile_mode=compile_mode, dense_dtype=dense_dtype,
    )
    settings = ServeSettings(api_key=api_key or None, max_queue=max_queue, max_body_bytes=max_body_bytes,
                             default_max_tokens=max_new_tokens, default_seed=seed, max_n=max_n,
                             cors_origins=tuple(cors_origin or ()))
    run_server(model, cfg, settings, host, port)


def served_name(model: Optional[str], path) -> str:
    """The model id clients ask for: the Hub id as given (``org/repo:QUANT`` for a GGUF repo), a GGUF
    file's name, else the folder's name (a GGUF file resolves to a prepared folder named by its path)."""
    from pathlib import Path

    if model is not None and Path(model).expanduser().is_file():
        return Path(model).expanduser().name
    if model is None or Path(model).expanduser().exists():
        return Path(path).name
    return model


def run_server(model: Optional[str], cfg, settings, host: str, port: int) -> None:
    """Load ``model``, serve it until Ctrl-C, then stop the worker and the runtime."""
    import uvicorn

    from moespec.chat.open_model import open_model
    from moespec.cli.runtime_opts import check_predictor_files
    from moespec.serve.app import create_app
    from moespec.serve.backend import ModelBackend

    check_predictor_files(model, cfg)  # a missing calibration/estimator file: said before loading
    opened = open_model(model, cfg, err_console)
    err_console.print(f"[dim]{opened.describe(cfg)}[/]", highlight=False)
    print_notes(opened.engine.om.notes)
    app = create_app(ModelBackend(opened, served_name(model, opened.path)), settings)
    err_console.print(f"serving [bold]{app.state.backend.name}[/] on http://{host}:{port}/v1 "
                      f"(metrics: /metrics)", highlight=False)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=2)
    try:
        try:
            _make_server(config, app.state.queue).run()
        finally:
            app.state.queue.close()
            opened.close()
    except KeyboardInterrupt:
        import os
        import sys

        err_console.print("stopped")
        sys.stdout.flush()
        sys.stderr.flush()
        # Why: everything is closed and moespec writes files atomically; the interpreter's own
        # teardown of torch takes seconds, and a stopped server must be gone within 2 s.
        os._exit(130)


def _make_server(config, queue):
    """A uvicorn server that stops the generation first when it shuts down."""
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, which stops the generation first when it shuts down (Ctrl-C, SIGTERM).

        Why: uvicorn waits up to timeout_graceful_shutdown for open responses and then cancels
        them (a CancelledError traceback); stopping the worker first ends every stream within
        one token (a 503 error event), so shutdown takes well under the 2 s. After it, uvicorn
        re-raises the signal: SIGINT ends as Ctrl-C (exit 130), SIGTERM as killed by SIGTERM.
        """

        def __init__(self, config, queue) -> None:
            super().__init__(config)
            self.queue = queue

        async def shutdown(self, sockets=None) -> None:
            self.queue.close(wait=False)
            await super().shutdown(sockets=sockets)

    return Server(config, queue)
