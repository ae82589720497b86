"""CheckpointSource: the loader's one seam to the weights, whatever format holds them.

The loader (runtime.load: load_offloaded, _load_weights, open_source picks the source) asks a source for the transformers config, the
layout of one expert row, a stream of tensors already mapped to where they go (an expert part of
the store, or a dense parameter by its in-memory name) and a fingerprint that cached derived files
(quantised stores) are keyed by. :class:`SafetensorsSource` reads a transformers folder (config.json
+ *.safetensors) through a bounded window of its file mapping (host.checkpoint.iter_tensors); a folder
that moespec prepared for a GGUF file (moespec.gguf.sidecar: config, tokenizer and the file's
tensor table) is read by host.gguf_source.GgufSource, which keeps experts in their GGUF blocks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, NamedTuple, Protocol

import torch

from moespec.errors import CheckpointError
from moespec.models.base import ExpertKey, MoeAdapter
from moespec.models.layout import ExpertLayout


class SourceTensor(NamedTuple):
    """One tensor from a source.

    Attributes:
        key: where an expert tensor goes in the store; None for a dense tensor.
        name: a dense tensor's in-memory parameter name; an expert tensor's checkpoint name (for messages).
        tensor: the data (CPU, or already on the load device).
        where: the file it came from, for messages.
        mapped: True when ``tensor`` views a file mapping (copy it before keeping it on the CPU).
    """

    key: ExpertKey | None
    name: str
    tensor: torch.Tensor
    where: str
    mapped: bool = False


class CheckpointSource(Protocol):
    """What the loader needs from a checkpoint.

    Attributes:
        folder: the model folder (config.json, tokenizer; calibration files are keyed by it).
    """

    folder: Path

    def config(self):
        """The transformers config."""

    def layout(self, adapter: MoeAdapter, dtype: torch.dtype, expert_dtype: str, group_size: int | None,
               requantize: bool = False) -> ExpertLayout:
        """One expert row's layout for ``--expert-dtype`` / ``--group-size`` (OptionError on a bad value)."""

    def tensors(self, adapter: MoeAdapter, layout: ExpertLayout, device: torch.device, dtype: torch.dtype,
                read_experts: bool) -> Iterator[SourceTensor]:
        """Every tensor, experts converted for ``layout`` (skipped unless ``read_experts``)."""

    def fingerprint(self) -> list[list]:
        """What identifies the weights (sizes, mtimes, header hashes), for cache keys."""


class SafetensorsSource:
    """A transformers checkpoint folder: config.json + *.safetensors.

    Raises:
        ModelNotFoundError, CheckpointError: see checkpoint.safetensors_files.
    """

    def __init__(self, folder: Path) -> None:
        from moespec.runtime.host.checkpoint import safetensors_files

        self.folder = Path(folder)
        self.files = safetensors_files(self.folder)

    def config(self):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.folder)

    def layout(self, adapter: MoeAdapter, dtype: torch.dtype, expert_dtype: str, group_size: int | None,
               requantize: bool = False) -> ExpertLayout:
        return adapter.layout(dtype, expert_dtype, group_size)

    def tensors(self, adapter: MoeAdapter, layout: ExpertLayout, device: torch.device, dtype: torch.dtype,
                read_experts: bool) -> Iterator[SourceTensor]:
        from moespec.runtime.host.checkpoint import iter_tensors

        convert = adapter.expert_converter(layout)
        skip = None if read_experts else (lambda name: adapter.expert_key(name) is not None)
        for name, tensor, file in iter_tensors(self.files, skip):
            key = adapter.expert_key(name)
            if key is None:
                yield SourceTensor(None, adapter.dense_name(name), tensor, file.name, mapped=True)
                continue
            try:
                converted = convert(key, tensor, name)
            except CheckpointError as exc:  # a shape or NaN weights: the file named too
                raise CheckpointError(f"{exc.message} (in {file.name})", exc.hint) from None
            for k, t, n in converted:
                yield SourceTensor(k, n, t, file.name, mapped=True)

    def fingerprint(self) -> list[list]:
        from moespec.runtime.host.quant_store import checkpoint_fingerprint

        return checkpoint_fingerprint(self.folder, self.files)
