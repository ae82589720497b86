"""The `moespec` Typer app: registers the commands.

Every command module is imported here but imports torch only inside its function body, so
`moespec --help` answers at once. Errors are turned into exit codes in `common.handles_errors`.
"""

from __future__ import annotations

import importlib
import logging

import typer

from moespec.cli.common import HelpFlag, MoespecGroup
# transformers imports torchao whenever it is installed (moespec[quant], for --expert-dtype int8/int4);
# on a CPU-only torch, torchao logs a warning for each optional CUDA kernel it cannot load, and torch
# one for each enum torchao registers. Neither concerns moespec: keep them out of the terminal.
for _logger in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_logger).setLevel(logging.ERROR)

app = typer.Typer(
    name="moespec",
    help="Run Mixture-of-Experts models with experts offloaded to host memory and prefetched ahead.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    add_help_option=False,  # HelpFlag below: the same --help without typer's "<bool>" type column
    cls=MoespecGroup,  # a wrong-type option value is one line, as every other bad value
)


def _print_version(value: bool) -> None:
    if value:
        from moespec import __version__

        typer.echo(f"moespec {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", metavar="", is_eager=True, callback=_print_version,
                                 help="Print moespec's version and exit."),
    help_: bool = HelpFlag,
) -> None:
    """Run Mixture-of-Experts models with experts offloaded to host memory and prefetched ahead."""

for _name in ("chat_cmd", "download_cmd", "calibrate_cmd", "profile_cmd", "estimator_cmd", "serve_cmd",
              "eval_cmd"):
    # Commands land one issue at a time; a module that is not there yet is simply not registered.
    try:
        _mod = importlib.import_module(f"moespec.cli.{_name}")
    except ModuleNotFoundError as _exc:
        if _exc.name != f"moespec.cli.{_name}":
            raise
        continue
    _mod.register(app)


def main() -> None:
    """Console entry point (`moespec`)."""
    app()
