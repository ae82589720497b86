"""Reading a checkpoint folder tensor by tensor, with errors that name the file.

A layer's tensors may be split across shards; each shard is opened once and read key by key,
so the whole checkpoint is never materialised at once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator

import torch

from moespec.errors import CheckpointError, ModelNotFoundError


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's shards, in index order when an index exists.

    Raises:
        ModelNotFoundError: no config.json.
        CheckpointError: no *.safetensors (e.g. only .bin or .gguf), or an index naming a missing shard.
    """
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(f"{folder} has no config.json", "pass a model folder or run `moespec download MODEL`")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index: {exc}") from exc
        files = [folder / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"shard(s) named in {index.name} are missing: {', '.join(missing)}",
                                  "download the model again (`moespec download MODEL`)")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in folder.iterdir() if p.suffix in {".bin", ".gguf", ".pt", ".pth"})
        extra = f" (found {', '.join(others)})" if others else ""
        raise CheckpointError(f"{folder} holds no *.safetensors weights{extra}",
                              "moespec reads safetensors checkpoints only; convert or download one")
    return files


def iter_tensors(files: list[Path], skip: Callable[[str], bool] | None = None
                 ) -> Iterator[tuple[str, torch.Tensor, Path]]:
    """Yield (name, tensor, file) for every tensor of every shard, one at a time.

    Tensors whose name ``skip`` accepts are not read (e.g. experts already loaded from a cache).

    Raises:
        CheckpointError: a file that is truncated or corrupt (names the file).
    """
    from safetensors import safe_open

    for path in files:
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own SafetensorError / OSError
            raise CheckpointError(f"{path} is not a readable safetensors file ({exc})",
                                  "the file is truncated or corrupt: download it again") from exc
        with handle:
            size = path.stat().st_size
            for name in handle.keys():
                if skip is not None and skip(name):
                    continue
                try:
                    tensor = handle.get_tensor(name)
                except Exception as exc:
                    raise CheckpointError(f"{path}: tensor {name} cannot be read ({exc}; file is {size} bytes)",
                                          "the file is truncated or corrupt: download it again") from exc
                yield name, tensor, path
