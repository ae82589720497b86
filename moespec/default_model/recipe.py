"""What decides the default model's weights, and one digest of it all.

The recipe is the conversion code (convert, split, router_fit, refit and this file), the
calibration texts, the pinned source file and RECIPE_VERSION. ``recipe_digest()`` hashes all of
them; a build records it, and a cached build is reused only when its digest equals the current
one. So a reused model is provably built by this code from this source: any edit to the code or
the data (a comment included: the hash is of the bytes) makes the next use rebuild it.

Shapes: N calibration windows of S tokens.
"""

from __future__ import annotations

import hashlib
from importlib import resources

import torch

RECIPE_VERSION = 6  # bump when the recipe changes on purpose (the digest changes anyway)
CALIB_WINDOWS, EVAL_WINDOWS, WINDOW_TOKENS = 64, 8, 512
CHAT_WINDOWS = 11  # of the CALIB_WINDOWS: all of chat_calibration.txt (5.9k tokens), the rest prose
# The files whose bytes decide the weights (moespec/default_model/... and moespec/data/...).
RECIPE_MODULES = ("recipe.py", "convert.py", "split.py", "router_fit.py", "refit.py")
RECIPE_DATA = ("sotu_calibration.txt", "chat_calibration.txt")


def recipe_digest() -> str:
    """Hex SHA-256 of RECIPE_VERSION, the recipe's source files, its data and the source checksum.

    Returns:
        64 hex characters; equal on two installs exactly when they would build the same recipe
        from the same source weights.
    """
    from moespec.default_model import source

    digest = hashlib.sha256(f"recipe {RECIPE_VERSION}\nsource {source.GGUF_SHA256}\n".encode())
    here = resources.files("moespec.default_model")
    data = resources.files("moespec.data")
    for folder, names in ((here, RECIPE_MODULES), (data, RECIPE_DATA)):
        for name in names:
            blob = folder.joinpath(name).read_bytes()
            digest.update(f"{name} {len(blob)}\n".encode())
            digest.update(blob)
    return digest.hexdigest()


def calibration_windows(tokenizer) -> torch.Tensor:
    """The conversion's calibration token ids: [CALIB_WINDOWS, WINDOW_TOKENS] int64.

    CHAT_WINDOWS windows of chat transcripts (moespec.data.chat_calibration_text), then prose
    (State of the Union addresses): a model that is mostly used to chat is fitted on chat turns
    too, and the last rows, which the conversion holds back to report its errors, stay prose.
    """
    from moespec.data import calibration_text, chat_calibration_text

    chat = token_windows(tokenizer, chat_calibration_text(), CHAT_WINDOWS, WINDOW_TOKENS)
    prose = token_windows(tokenizer, calibration_text(), CALIB_WINDOWS - CHAT_WINDOWS, WINDOW_TOKENS)
    return torch.cat([chat, prose])


def token_windows(tokenizer, text: str, n_windows: int, seq_len: int) -> torch.Tensor:
    """Token ids of ``text`` cut into ``n_windows`` windows: [N, S] int64.

    Raises:
        ValueError: the text has fewer than n_windows * seq_len tokens.
    """
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    need = n_windows * seq_len
    if ids.numel() < need:
        raise ValueError(f"text has {ids.numel()} tokens, {need} needed")
    return ids[:need].reshape(n_windows, seq_len)
