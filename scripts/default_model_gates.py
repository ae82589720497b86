"""Measure the default model's quality gates; the last stdout line is one JSON object.

    python scripts/default_model_gates.py [--rebuild [--full]] [--record] [--windows 8]

Builds the model if needed (--rebuild forces a fresh conversion; --full runs the full recipe
instead of the recorded fits), loads the built folder with plain transformers (moespec's `exact`
mode gives the same output by contract) and the dense source from the cached wheel, and measures
on held-out text: dense, routed and random-routing perplexity, routed byte share, E, K, short
answers. --record writes them to moespec/default_model/recorded_gates.json (the numbers every
build's model card shows) and, after a --full build, the fits it made to
moespec/default_model/recipe_fits.safetensors (what users' builds start from). Exit code 1 when a
gate fails.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rebuild", action="store_true", help="convert again")
    parser.add_argument("--full", action="store_true", help="with --rebuild: the full recipe, not the recorded fits")
    parser.add_argument("--record", action="store_true", help="write the numbers (and fits) into the package")
    parser.add_argument("--windows", type=int, default=8, help="held-out windows of 512 tokens")
    args = parser.parse_args()

    from rich.console import Console

    from moespec.default_model import ensure_default_model, fits, gates
    from moespec.default_model.build import build_marker, refresh_card
    from moespec.default_model.recipe import recipe_digest

    console = Console(stderr=True)
    folder = ensure_default_model(console, rebuild=args.rebuild, full=args.full)
    report = gates.measure_built(folder, console, args.windows).to_json()
    for gate, ok in report["checks"].items():
        console.print(f"{'[green]pass[/]' if ok else '[red]fail[/]'}  {gate}")
    marker = build_marker(folder) or {}
    if args.record:
        recorded = {"recipe_digest": recipe_digest(), "versions": marker.get("versions", {}), **report}
        path = gates.recorded_path()
        path.write_text(json.dumps(recorded, indent=2) + "\n", encoding="utf-8")
        console.print(f"recorded the numbers in {path}")
        refresh_card(folder, recorded)
        made = folder / fits.FITS_FILE
        if made.is_file():
            shutil.copy(made, fits.fits_path())
            console.print(f"recorded the fits of this full build in {fits.fits_path()}")
    print(json.dumps({"model": str(folder), "build_s": marker.get("build_s"), **report}))
    return 0 if report["all_pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
