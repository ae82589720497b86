"""Record the calibration shipped for the default model (moespec/default_model/default_calibration.safetensors).

Runs `moespec calibrate` on the default model (built first if needed) with the shipped text, stamps
the file with the recipe digest of the build it was made on (artifacts.shipped_calibration offers it
only to builds of that recipe) and keeps only the chosen default-vector variant (the others are read
by no runtime path; their recall stays in the metrics): about 1.1 MB instead of 2.2 MB. The file
records no clock time, so on one machine the same recipe, text and tokens give the same bytes
(another CPU's float rounding may move the default vectors in their last bits; the router
fingerprint, of the recorded routers, does not move). Run it again whenever the recipe digest
changes (tests/test_shipped_calibration.py says so). Usage:

  PYTHONPATH=$PWD python scripts/record_default_calibration.py [--tokens 100000] [--data FILE]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> None:
    from moespec.artifacts import SHIPPED_CALIBRATION
    from moespec.default_model import ensure_default_model
    from moespec.default_model.recipe import recipe_digest
    from moespec.integrity import DIGEST_KEY
    from moespec.predict.calibration_file import load_calibration, save_calibration

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=100_000, help="calibration tokens (the shipped text holds ~60k)")
    ap.add_argument("--data", help="text to calibrate on (default: the shipped text)")
    ap.add_argument("--out", type=Path, default=SHIPPED_CALIBRATION)
    args = ap.parse_args()
    folder = ensure_default_model()
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "calibration.safetensors"
        cmd = [sys.executable, "-m", "moespec", "calibrate", str(folder), "--tokens", str(args.tokens),
               "--out", str(raw)] + (["--data", args.data] if args.data else [])
        subprocess.run(cmd, check=True)
        calib = load_calibration(raw)
    calib.default_vectors = {calib.variant: calib.vectors}
    # "model": the key a build is known by (its folder name), not this machine's path to it.
    keep = {k: v for k, v in calib.meta.items() if k not in ("format", "format_version", "variant", DIGEST_KEY)}
    calib.meta = dict(keep, model=folder.name, recipe_digest=recipe_digest())
    save_calibration(args.out, calib)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.2f} MB, recipe {recipe_digest()[:12]}, "
          f"{calib.meta['tokens']} tokens, variant {calib.variant})")


if __name__ == "__main__":
    main()
