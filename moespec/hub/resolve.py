"""Resolve MODEL (a local folder or a Hub id) to a folder with config.json + safetensors.

Offline first: a Hub id is looked up in the local Hub cache without any network call.
"""

from __future__ import annotations

from pathlib import Path

from moespec.errors import ModelNotFoundError


def resolve_model(model: str, revision: str | None = None) -> Path:
    """Return the local folder of ``model``.

    Args:
        model: a folder path, or a Hub id ("org/name") already in the local Hub cache.
        revision: Hub revision (branch, tag or commit); None = the cached "main".

    Raises:
        ModelNotFoundError: neither a folder nor a cached Hub id (hint: `moespec download`).
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    looks_like_path = model.startswith((".", "/", "~")) or path.suffix != "" or model.count("/") > 1
    if not looks_like_path:
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(model, revision=revision, local_files_only=True))
        except Exception:  # not in the cache (LocalEntryNotFoundError) or an invalid id
            pass
    raise ModelNotFoundError(
        f"model {model!r} is neither a local folder nor a Hub id in the local Hub cache",
        f"run `moespec download {model}` first, or pass a folder with config.json and *.safetensors",
    )
