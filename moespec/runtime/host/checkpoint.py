"""Reading a checkpoint folder tensor by tensor, with errors that name the file.

A layer's tensors may be split across shards; each shard is read key by key, so the whole
checkpoint is never materialised at once.

safetensors' ``safe_open`` maps the whole shard and ``get_tensor`` returns a view of that mapping
(safetensors 0.8: no copy). Every page read stays resident in the process - counted in its RSS as
file pages, what ``ps`` and ``time -v`` report - for as long as the mapping lives, and the mapping
lives while any tensor viewing it does. So :func:`iter_tensors` reopens a shard after every
``window_bytes`` of tensors it yielded (dropping the old mapping once its last tensor is gone), and
a caller that keeps a tensor copies it out of the mapping (the loader does for dense weights on
the CPU). The resident pages of the checkpoint then stay under ``window_bytes`` + one tensor.
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
    # moespec's own files beside a model (moespec-calibration/-estimator.safetensors) are not weights
    files = sorted(p for p in folder.glob("*.safetensors") if not p.name.startswith("moespec-"))
    if not files:
        others = sorted(p.name for p in folder.iterdir() if p.suffix in {".bin", ".gguf", ".pt", ".pth"})
        extra = f" (found {', '.join(others)})" if others else ""
        raise CheckpointError(f"{folder} holds no *.safetensors weights{extra}",
                              "moespec reads safetensors checkpoints only; convert or download one")
    return files


# Bytes of one shard mapping read before the shard is reopened: small against any model, large
# against a tensor, so reopening (a header parse) costs nothing next to the reading.
WINDOW_BYTES = 16 * 2**20


class MappingWindow:
    """One safetensors file read through ``safe_open``, reopened after every ``window_bytes`` read.

    ``handle()`` gives the open handle (reopening first once the window is used up), ``count(n)``
    adds bytes read through it. Closing a handle drops its mapping as soon as no tensor views it.
    A context manager; ``close()`` is idempotent.

    Raises:
        CheckpointError: (from ``handle``) the file is not a readable safetensors file.
    """

    def __init__(self, path: Path, window_bytes: int = WINDOW_BYTES) -> None:
        self.path, self.window_bytes = Path(path), window_bytes
        self._handle, self._mapped = None, 0
        self.opened = 0  # how many times the file was (re)opened

    def handle(self):
        """The open ``safe_open`` handle of the file."""
        if self._handle is None or self._mapped >= self.window_bytes:
            self.close()
            self._handle, self._mapped = _open(self.path), 0
            self.opened += 1
        return self._handle

    def count(self, nbytes: int) -> None:
        """Record ``nbytes`` read through the current handle."""
        self._mapped += nbytes

    def close(self) -> None:
        """Close the handle (its mapping goes once the last tensor viewing it is gone)."""
        if self._handle is not None:
            self._handle.__exit__(None, None, None)
            self._handle = None

    def __enter__(self) -> MappingWindow:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def iter_tensors(files: list[Path], skip: Callable[[str], bool] | None = None,
                 window_bytes: int = WINDOW_BYTES) -> Iterator[tuple[str, torch.Tensor, Path]]:
    """Yield (name, tensor, file) for every tensor of every shard, one at a time.

    Each tensor is a view of the shard's file mapping: a caller that keeps it past the next step
    must copy it (see the module docstring). The shard is reopened after every ``window_bytes``
    yielded, so no more than that (+ one tensor) of the checkpoint is mapped and resident once
    the caller has dropped what it read. Tensors whose name ``skip`` accepts are not read (e.g.
    experts already loaded from a cache).

    Raises:
        CheckpointError: a file that is truncated or corrupt (names the file).
    """
    for path in files:
        size = path.stat().st_size
        with MappingWindow(path, window_bytes) as shard:
            for name in list(shard.handle().keys()):
                if skip is not None and skip(name):
                    continue
                try:
                    tensor = shard.handle().get_tensor(name)
                except Exception as exc:
                    raise CheckpointError(f"{path}: tensor {name} cannot be read ({exc}; file is {size} bytes)",
                                          "the file is truncated or corrupt: download it again") from exc
                shard.count(tensor.numel() * tensor.element_size())
                yield name, tensor, path
                del tensor  # the generator's own reference would keep the mapping alive


def _open(path: Path):
    """``safe_open`` of one file, entered (its ``__exit__`` drops the mapping).

    Raises:
        CheckpointError: the file is not a readable safetensors file.
    """
    from safetensors import safe_open

    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
        handle.__enter__()
    except Exception as exc:  # safetensors raises its own SafetensorError / OSError
        raise CheckpointError(f"{path} is not a readable safetensors file ({exc})",
                              "the file is truncated or corrupt: download it again") from exc
    return handle
