"""Which files of a checkpoint moespec needs, and whether a folder has them.

moespec loads config.json + safetensors weights + tokenizer files; everything else in a repo
(PyTorch .bin, GGUF, ONNX, ``original/`` copies of the weights) is skipped. When the repo has a
``model.safetensors.index.json`` only the shards it names are weights, so a repo that carries
both ``consolidated.safetensors`` and sharded files downloads the weights once.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from moespec.errors import CheckpointError

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"

# Top-level files besides the weights: config, tokenizer, chat template, license and card.
META_PATTERNS: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    INDEX_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.tiktoken",
    "chat_template.jinja",
    "chat_template.json",
    "LICENSE*",
    "README.md",
)
OTHER_WEIGHT_SUFFIXES: tuple[str, ...] = (".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".onnx")


@dataclass(frozen=True)
class CheckpointFiles:
    """The repo files moespec fetches, split by role; all paths are relative to the repo root."""

    meta: list[str]
    weights: list[str]
    skipped: list[str] = field(default_factory=list)

    @property
    def wanted(self) -> list[str]:
        """meta + weights, sorted: the exact list handed to the downloader."""
        return sorted({*self.meta, *self.weights})


def _is_meta(path: str) -> bool:
    return "/" not in path and any(fnmatch.fnmatchcase(path, pat) for pat in META_PATTERNS)


def index_shards(index: dict) -> list[str]:
    """Shard file names named by a parsed ``model.safetensors.index.json`` (sorted, unique).

    Raises:
        CheckpointError: the index has no ``weight_map`` object.
    """
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{INDEX_FILE} has no weight_map", "re-download the model with `moespec download`")
    return sorted({str(v) for v in weight_map.values()})


def select_files(paths: Iterable[str], model: str, index: dict | None = None) -> CheckpointFiles:
    """Pick the files moespec needs from a repo listing.

    Args:
        paths: every file in the repo (relative, "/"-separated).
        model: Hub id or folder, named in errors.
        index: the parsed safetensors index when the repo has one (its shards are the weights).

    Raises:
        CheckpointError: no config.json; no safetensors weights (the message says which other
            formats the repo has, e.g. only .bin or GGUF); shards named by the index are missing.
    """
    all_paths = sorted(set(paths))
    ggufs = [p for p in all_paths if p.endswith(".gguf") and not p.rsplit("/", 1)[-1].startswith("mmproj")]
    if CONFIG_FILE not in all_paths and ggufs:
        from moespec.gguf.files import quant_of

        quants = sorted({quant_of(p) for p in ggufs} - {""})
        raise CheckpointError(f"{model} is a GGUF repo ({', '.join(quants) or len(ggufs)} files) with no config.json",
                              f"pick one quant: `moespec download {model} --quant {quants[0] if quants else 'Q4_K_M'}`")
    if CONFIG_FILE not in all_paths:
        raise CheckpointError(
            f"{model} has no config.json at its root, so it is not a transformers checkpoint",
            "pass a Hub id or folder of a transformers model with config.json and *.safetensors",
        )
    if index is not None:
        weights = index_shards(index)
        missing = [w for w in weights if w not in all_paths]
        if missing:
            raise CheckpointError(
                f"{model}: {INDEX_FILE} names {len(missing)} shard(s) that are not there: {', '.join(missing[:3])}",
                "re-run `moespec download` to fetch the missing shards",
            )
    else:
        weights = [p for p in all_paths if "/" not in p and p.endswith(".safetensors")]
    if not weights:
        other = sorted({Path(p).suffix for p in all_paths if p.endswith(OTHER_WEIGHT_SUFFIXES)})
        found = f"only {' / '.join(other)} weights" if other else "no weight files"
        raise CheckpointError(
            f"{model} has {found} and no *.safetensors; moespec loads safetensors checkpoints only",
            "use a repo that publishes safetensors (the original model repo usually does), "
            "or convert the weights with transformers' save_pretrained",
        )
    meta = [p for p in all_paths if _is_meta(p)]
    chosen = set(meta) | set(weights)
    return CheckpointFiles(meta=meta, weights=weights, skipped=[p for p in all_paths if p not in chosen])


def local_files(folder: Path) -> list[str]:
    """Every file under ``folder`` as a "/"-separated relative path (hidden folders skipped)."""
    out = []
    for p in folder.rglob("*"):
        rel = p.relative_to(folder)
        if p.is_file() and not any(part.startswith(".") for part in rel.parts):
            out.append(rel.as_posix())
    return out


def check_local_checkpoint(folder: Path, model: str) -> CheckpointFiles:
    """Check that ``folder`` holds a runnable checkpoint and return its files (a GGUF repo's snapshot
    or a folder moespec prepared for a GGUF is accepted as it is: moespec.gguf checks those).

    Raises:
        CheckpointError: see :func:`select_files`; also an unreadable index.
    """
    from moespec.gguf import SOURCE_FILE

    if (folder / SOURCE_FILE).is_file():  # prepared by moespec for a GGUF: the weights are the GGUF's
        return CheckpointFiles(meta=[p for p in local_files(folder) if _is_meta(p)], weights=[])
    present = local_files(folder)
    if CONFIG_FILE not in present and any(p.endswith(".gguf") for p in present):  # a GGUF repo's snapshot
        return CheckpointFiles(meta=[p for p in present if _is_meta(p)], weights=sorted(p for p in present if p.endswith(".gguf")))
    index = None
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{index_path} is not readable JSON: {exc}", "re-download the model") from exc
    return select_files(present, model, index)
