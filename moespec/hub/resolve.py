"""Resolve MODEL (a local folder or a Hub id) to a folder with config.json + safetensors.

A GGUF model (a .gguf file, a split set, a folder or a cached Hub repo holding one, ``MODEL:QUANT``)
resolves to the folder moespec prepares for it (moespec.gguf.resolve).

A bare name such as ``smollm2-135m-moe-e16k4`` (the embedded default model) is a model moespec
built, in ``moespec.paths.models_dir()``. Offline first: a Hub id is looked up in the local Hub cache (``HF_HUB_CACHE``, by default
``~/.cache/huggingface/hub``) with no network call at all, so every command runs the same with
or without network and with ``HF_HUB_OFFLINE=1``. Nothing is downloaded here; a model that is
not in the cache gets an error naming `moespec download`.
"""

from __future__ import annotations

import os
from pathlib import Path

from moespec.errors import CheckpointError, ModelNotFoundError
from moespec.hub.checkpoint_files import CONFIG_FILE, check_local_checkpoint
from moespec.hub.errors import hub_offline
from moespec.paths import DEFAULT_MODEL_FOLDER, display_path, models_dir


def _looks_like_path(model: str) -> bool:
    return model.startswith((".", "/", "~")) or "\\" in model or model.count("/") > 1 or model.endswith("/")


def hub_cache_dir() -> Path:
    """The Hub cache folder huggingface_hub uses (``HF_HUB_CACHE`` / ``HF_HOME``/hub)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def cached_refs(repo_id: str) -> list[str]:
    """Branches/tags of ``repo_id`` recorded in the local Hub cache (e.g. ["main", "v1.0"])."""
    from huggingface_hub.file_download import repo_folder_name

    refs = hub_cache_dir() / repo_folder_name(repo_id=repo_id, repo_type="model") / "refs"
    if not refs.is_dir():
        return []
    return sorted(p.relative_to(refs).as_posix() for p in refs.rglob("*") if p.is_file())


def cached_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The cached snapshot folder of ``repo_id`` at ``revision`` (None = main), or None; no network.

    Raises:
        ModelNotFoundError: ``repo_id`` is not a valid Hub id.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        folder = snapshot_download(repo_id, revision=revision, local_files_only=True, allow_patterns=[CONFIG_FILE])
    except HFValidationError as exc:
        raise ModelNotFoundError(
            f"{repo_id!r} is neither a local folder nor a valid Hub id ({exc})",
            "pass a folder with config.json and *.safetensors, or a Hub id like Qwen/Qwen3-30B-A3B",
        ) from exc
    except LocalEntryNotFoundError:  # includes IncompleteSnapshotError: config.json itself is missing
        return None
    return Path(folder)


def resolve_model(model: str, revision: str | None = None) -> Path:
    """Return the local folder of ``model``, checked to hold config.json and safetensors weights.

    Args:
        model: a folder path, or a Hub id ("org/name") already in the local Hub cache; or a GGUF model
            (a .gguf path, a folder or cached Hub repo with GGUF files, optionally ``:QUANT``).
        revision: Hub revision (branch, tag or commit); None = the cached "main". Ignored for folders.

    Raises:
        ModelNotFoundError: the folder does not exist, or the Hub id (at this revision) is not
            in the local cache (hint: `moespec download`, with --revision when one was asked for).
        CheckpointError: the folder or snapshot lacks config.json, has no *.safetensors (e.g. only
            .bin or GGUF weights) or misses shards named by its index (an interrupted download).
    """
    from moespec.gguf.resolve import resolve_gguf

    gguf = resolve_gguf(model, revision)  # a .gguf file, split set, folder or Hub repo holding one
    if gguf is not None:
        return gguf
    path = Path(model).expanduser()
    if path.is_dir():
        check_local_checkpoint(path, model)
        return path
    built = _built_model(model)
    if built is not None:
        return built
    if path.exists() or _looks_like_path(model):
        what = "is a file, not a folder" if path.exists() else "does not exist"
        raise ModelNotFoundError(
            f"model folder {model} {what}",
            "pass a folder with config.json and *.safetensors, a .gguf file, or a Hub id like Qwen/Qwen3-30B-A3B",
        )
    folder = cached_snapshot(model, revision)
    if folder is None:
        raise _not_cached(model, revision)
    try:
        check_local_checkpoint(folder, model)
    except CheckpointError as exc:  # e.g. a download stopped after config.json
        download = f"moespec download {model}" + (f" --revision {revision}" if revision else "")
        raise CheckpointError(f"the cached copy of {model} is incomplete: {exc.message}", f"run `{download}` to complete it") from exc
    return folder


def _built_model(name: str) -> Path | None:
    """The folder of the model moespec built under ``name`` (``moespec models`` lists it), or None.

    Raises:
        ModelNotFoundError: ``name`` is the default model's and it is not built yet.
        CheckpointError: the folder is there but incomplete.
    """
    if not name or "/" in name or "\\" in name or name.startswith("."):
        return None
    folder = models_dir() / name
    if (folder / CONFIG_FILE).is_file():
        check_local_checkpoint(folder, name)
        return folder
    if name == DEFAULT_MODEL_FOLDER:
        raise ModelNotFoundError(f"the default model {name} is not built yet (it goes to {display_path(folder)})",
                                 "run `moespec download --default` or `moespec chat` with no MODEL to build it")
    return None


def _not_cached(model: str, revision: str | None) -> ModelNotFoundError:
    at_rev = f" at revision {revision!r}" if revision else ""
    refs = cached_refs(model)
    have = f" (cached revisions: {', '.join(refs)})" if refs else ""
    download = f"moespec download {model}" + (f" --revision {revision}" if revision else "")
    if hub_offline():
        hint = f"HF_HUB_OFFLINE is set: run `{download}` where the Hub is reachable (same HF_HOME), or pass a model folder"
    else:
        hint = f"run `{download}` first, or pass a folder with config.json and *.safetensors"
    where = os.fspath(hub_cache_dir())
    return ModelNotFoundError(
        f"model {model!r}{at_rev} is neither a local folder nor in the local Hub cache {where}{have}", hint
    )
