"""MODEL -> a prepared GGUF folder: a .gguf file, a split part, a folder holding one, or a Hub repo.

``MODEL:QUANT`` picks one model where several sit together (a Hub GGUF repo usually carries a
dozen quant types; ``moespec download REPO --quant Q4_K_M`` fetches one set, llama.cpp's
``-hf REPO:QUANT`` spelling). A Hub repo is looked up in the local Hub cache only (offline, as
moespec.hub.resolve does for safetensors). Anything else is left to the safetensors resolver
(None): a folder with config.json, a Hub id whose snapshot has config.json.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from moespec.errors import ModelNotFoundError
from moespec.gguf.files import find_model, is_gguf, models_in, quant_label

_QUANT_SUFFIX = re.compile(r"^(?P<base>.+):(?P<quant>[A-Za-z0-9_-]+)$")


def split_quant(model: str) -> tuple[str, str | None]:
    """"org/repo:Q4_K_M" -> ("org/repo", "Q4_K_M"); a MODEL without a quant suffix -> (model, None)."""
    m = _QUANT_SUFFIX.match(model)
    if m and quant_label(f"x-{m.group('quant')}") and not Path(model).exists():
        return m.group("base"), m.group("quant").upper()
    return model, None


def resolve_gguf(model: str, revision: str | None = None) -> Path | None:
    """The prepared folder of MODEL when it names a GGUF model, else None.

    Raises:
        ModelNotFoundError: no GGUF model there (or several and no :QUANT), a Hub GGUF repo not in
            the cache (names `moespec download REPO --quant ...`).
        CheckpointError, UnsupportedModelError, OutputError: from preparing it (moespec.gguf.sidecar).
    """
    from moespec.gguf.sidecar import prepare

    base, quant = split_quant(model)
    path = Path(base).expanduser()
    if path.is_file() and is_gguf(path):
        files = find_model(path)
        return prepare(files, os.path.abspath(files.first))
    if path.is_dir():
        if (path / "config.json").is_file() and quant is None:
            return None
        if quant is None and not models_in(path):
            return None
        files = find_model(path, quant)
        return prepare(files, os.path.abspath(files.first))
    if path.exists() or base.count("/") != 1 or base.startswith((".", "/", "~")):
        return None
    snapshot = cached_snapshot_dir(base, revision)
    if snapshot is None or ((snapshot / "config.json").is_file() and quant is None):
        if quant is not None:
            at = f" --revision {revision}" if revision else ""
            raise ModelNotFoundError(f"GGUF model {model} is not in the local Hub cache",
                                     f"run `moespec download {base} --quant {quant}{at}` first")
        return None
    if quant is None and not models_in(snapshot):
        return None
    files = find_model(snapshot, quant)
    key = f"{base}:{files.quant}" if files.quant else base
    return prepare(files, key + (f"@{revision}" if revision else ""))


def cached_snapshot_dir(repo_id: str, revision: str | None = None) -> Path | None:
    """The Hub cache's snapshot folder of ``repo_id`` at ``revision`` (a ref or a commit), or None; no network."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    try:  # the Hub cache folder (HF_HUB_CACHE), as moespec.hub.resolve reads it
        repo = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")
    except Exception:  # an invalid id: not ours to explain
        return None
    rev = revision or "main"
    ref = repo / "refs" / rev
    commit = ref.read_text().strip() if ref.is_file() else rev
    folder = repo / "snapshots" / commit
    return folder if folder.is_dir() else None
