"""The `moespec` Typer app: registers the commands.

Every command module is imported here but imports torch only inside its function body, so
`moespec --help` answers at once. Errors are turned into exit codes in `common.handles_errors`.
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="moespec",
    help="Run Mixture-of-Experts models with experts offloaded to host memory and prefetched ahead.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)

for _name in ("chat_cmd", "download_cmd", "calibrate_cmd", "profile_cmd", "estimator_cmd", "serve_cmd"):
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
