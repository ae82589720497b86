"""What `moespec models` shows: the MoE checkpoints on this machine and what moespec derived from them.

Reads the local Hub cache (``scan_cache_dir``, no network) and the folders moespec built itself
(``moespec_home()/models``); for each model: architecture, bytes on disk, the config-derived size
breakdown, and whether a calibration and an estimator file exist.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from moespec.artifacts import calibration_candidates, estimator_candidates
from moespec.hub.checkpoint_files import CONFIG_FILE, check_local_checkpoint
from moespec.hub.sizes import ModelSizes, model_sizes, sized_model_types
from moespec.hub.support import SUPPORTED_MODEL_TYPES
from moespec.errors import CheckpointError, UnsupportedModelError
from moespec.gguf.files import GgufFiles, split_parts
from moespec.paths import models_dir, moespec_home


@dataclass(frozen=True)
class LocalModel:
    """One model found on this machine.

    Attributes:
        model_id: the Hub id, or the folder path for models moespec built.
        source: "hub" (Hub cache), "moespec" (built by moespec, e.g. the default model) or "gguf" (a
            local .gguf file moespec has run; Hub GGUF repos are "hub", one entry per quant).
        refs: branches/tags pointing at this snapshot (Hub models), e.g. ("main",).
        commit: the snapshot's commit hash ("" for built models).
        path: the folder holding config.json.
        model_type: config.json's model_type ("" when unreadable).
        disk_bytes: bytes of the files on disk.
        sizes: config-derived size breakdown; None when the model_type has no size rule.
        status: "ok" (moespec can run it), "unsupported" (architecture) or "incomplete"
            (no safetensors weights or missing shards, e.g. an interrupted download).
        has_calibration / has_estimator: the derived files exist (moespec.artifacts).
        partial_bytes: bytes of unfinished downloads of this repo (``blobs/*.incomplete``), counted
            in ``disk_bytes`` too; the next `moespec download` resumes them.
    """

    model_id: str
    source: str
    refs: tuple[str, ...]
    commit: str
    path: Path
    model_type: str
    disk_bytes: int
    sizes: ModelSizes | None
    status: str
    has_calibration: bool
    has_estimator: bool
    partial_bytes: int = 0

    @property
    def runnable(self) -> bool:
        return self.status == "ok"


def _read_config(folder: Path) -> dict:
    try:
        return json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _sizes_or_none(config: dict, model_type: str) -> ModelSizes | None:
    if model_type not in sized_model_types():
        return None
    try:
        return model_sizes(config)
    except UnsupportedModelError:  # a config missing a field: list the model without sizes
        return None


def _describe(model_id: str, source: str, refs: tuple[str, ...], commit: str, folder: Path, disk_bytes: int) -> LocalModel:
    config = _read_config(folder)
    model_type = str(config.get("model_type") or "")
    try:
        check_local_checkpoint(folder, model_id)
        status = "ok" if model_type in SUPPORTED_MODEL_TYPES else "unsupported"
    except CheckpointError:
        status = "incomplete"
    return LocalModel(
        model_id=model_id,
        source=source,
        refs=refs,
        commit=commit,
        path=folder,
        model_type=model_type,
        disk_bytes=disk_bytes,
        sizes=_sizes_or_none(config, model_type),
        status=status,
        has_calibration=any(p.is_file() for p in calibration_candidates(folder)),
        has_estimator=any(p.is_file() for p in estimator_candidates(folder)),
    )


def _hub_models(cache_dir: Path) -> list[LocalModel]:
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(cache_dir)
    except CacheNotFound:
        return []
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model":
            continue
        # scan_cache_dir counts only finished blobs; a killed download's parts are on disk too
        partial = sum(p.stat().st_size for p in (Path(repo.repo_path) / "blobs").glob("*.incomplete"))
        for rev in sorted(repo.revisions, key=lambda r: (not r.refs, sorted(r.refs), r.commit_hash)):
            refs = tuple(sorted(rev.refs))
            if not (Path(rev.snapshot_path) / CONFIG_FILE).is_file():  # a GGUF repo, or not a transformers model
                out += _hub_gguf_models(repo.repo_id, refs, rev.commit_hash, Path(rev.snapshot_path))
                continue
            model = _describe(repo.repo_id, "hub", refs, rev.commit_hash, Path(rev.snapshot_path),
                              rev.size_on_disk + partial)
            out.append(dataclasses.replace(model, partial_bytes=partial))
    return out


def _built_models(root: Path) -> list[LocalModel]:
    if not root.is_dir():
        return []
    out = []
    for folder in sorted(p for p in root.iterdir() if (p / CONFIG_FILE).is_file()):
        disk = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        out.append(_describe(os.path.abspath(folder), "moespec", (), "", folder, disk))
    return out


def list_local_models(cache_dir: Path | None = None) -> list[LocalModel]:
    """Every model in the Hub cache (``cache_dir``, default HF_HUB_CACHE) and in moespec's models folder,
    and the GGUF models among them and moespec has run (one entry per quant set).

    Hub models come first, sorted by id; a repo with several cached revisions gives one entry each.
    Never touches the network.
    """
    from moespec.hub.resolve import hub_cache_dir

    return _hub_models(cache_dir or hub_cache_dir()) + _local_gguf_models() + _built_models(models_dir())


def _gguf_row(key: str, source: str, refs: tuple, commit: str, files: GgufFiles):
    """The LocalModel of one GGUF model known as ``key`` (its sizes: moespec.hub.gguf_repos)."""
    from moespec.gguf.sidecar import sidecar_dir
    from moespec.hub.gguf_repos import describe_gguf

    model_type, sizes, status = describe_gguf(files, key)
    folder = sidecar_dir(key)
    return LocalModel(model_id=key, source=source, refs=refs, commit=commit, path=files.first, model_type=model_type,
                      disk_bytes=files.total_bytes, sizes=sizes, status=status,
                      has_calibration=any(p.is_file() for p in calibration_candidates(folder)),
                      has_estimator=any(p.is_file() for p in estimator_candidates(folder)))


def _hub_gguf_models(repo_id: str, refs: tuple, commit: str, snapshot: Path) -> list:
    """One row per GGUF model (quant) in a Hub cache snapshot, named ``org/repo:QUANT``."""
    from moespec.hub.gguf_repos import hub_gguf_sets

    return [_gguf_row(f"{repo_id}:{f.quant}" if f.quant else repo_id, "hub", refs, commit, f) for f in hub_gguf_sets(snapshot)]


def _local_gguf_models() -> list:
    """One row per local .gguf moespec has prepared (named by its path; Hub ones are listed with the Hub's)."""
    from moespec.gguf.sidecar import read_marker

    root, out = moespec_home() / "gguf", []
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        data = read_marker(folder)
        key = str(data.get("key")) if data else ""
        if not (os.path.isabs(key) and Path(key).is_file()):
            continue
        try:
            out.append(_gguf_row(key, "gguf", (), "", split_parts(Path(data["checkpoint"]["parts"][0]))))
        except CheckpointError:  # a split part went missing since
            continue
    return out
