"""GgufSource: the loader's CheckpointSource for a GGUF model (moespec.runtime.host.source).

Shapes: E experts, I expert intermediate, H hidden.

Dense tensors are read one at a time, dequantised on the load device (moespec.gguf.dequant) and
undone as llama.cpp's converter changed them (names.apply); a tensor larger than 64 MiB as float32
is dequantised in row chunks straight into the compute dtype, so no float32 copy of an embedding
ever exists beside it. What the first start dequantised is kept (dense_cache.py) and read back by
the next, which then neither dequantises nor reads the GGUF's dense tensors (each cached tensor is
checked against its checksum before it is handed on; a damaged cache is made again). Expert tensors stay in their GGUF blocks (layout.GgufLayout): each expert's
byte range is read from the file in chunks of whole experts (<= 16 MiB) and written into its store
row. With ``--expert-dtype`` the compute dtype (or int8/int4 on F32/F16/BF16 experts, or with
``--requantize``) experts are dequantised at load instead and go through the adapter's converter,
as safetensors experts do.
"""

from __future__ import annotations

import math

from pathlib import Path
from typing import Iterator

import torch

from moespec.errors import CheckpointError, OptionError
from moespec.gguf import SOURCE_FILE
from moespec.gguf.dense_cache import DenseCacheWriter, cache_file, cached_digests, tensor_digest
from moespec.gguf.dequant import FLOAT_TYPES, check_supported, dequantize, type_name
from moespec.gguf.layout import GgufGptOssLayout, GgufLayout, GgufPart, LayeredLayout
from moespec.gguf.names import apply, dense_plans, expert_names
from moespec.gguf.reader import GgufCheckpoint, TensorInfo
from moespec.gguf.sidecar import is_current, read_marker
from moespec.models.base import ExpertKey, MoeAdapter
from moespec.models.layout import ExpertLayout
from moespec.models.quant import ExpertQuant
from moespec.runtime.host.source import SourceTensor

CHUNK_BYTES = 16 * 2**20  # expert bytes read per file read
DENSE_CHUNK_BYTES = 64 * 2**20  # float32 bytes above which a dense tensor is dequantised in row chunks
_BIAS_PARTS = {"gate": "gate_bias", "up": "up_bias", "down": "down_bias"}


class GgufSource:
    """A prepared GGUF folder (moespec.gguf.sidecar) and the file it describes.

    Raises:
        CheckpointError: (open) the folder's marker is unreadable, or the file changed since it was prepared.
    """

    def __init__(self, folder: Path, ck: GgufCheckpoint, marker: dict) -> None:
        self.folder, self.ck, self._marker = Path(folder), ck, marker
        self._config = None
        self.notes: list[str] = []  # one line each for the user (a dense cache that could not be written)

    @classmethod
    def open(cls, folder: Path) -> GgufSource:
        data = read_marker(folder)
        if data is None:
            raise CheckpointError(f"{folder / SOURCE_FILE} is unreadable", f"delete {folder} and pass the .gguf again")
        if not is_current(data):
            raise CheckpointError(f"the GGUF behind {folder} changed since moespec prepared it",
                                  f"pass the .gguf file (or {data.get('key')}) again: moespec re-reads it")
        return cls(folder, GgufCheckpoint.from_json(data["checkpoint"]), data)

    @property
    def key(self) -> str:
        """What the model is known by: the .gguf path or "org/repo:QUANT"."""
        return str(self._marker.get("key"))

    def config(self):
        if self._config is None:
            from transformers import AutoConfig

            self._config = AutoConfig.from_pretrained(self.folder)
        return self._config

    def fingerprint(self) -> list[list]:
        return self._marker["fingerprints"]

    # --- experts -----------------------------------------------------------------------------
    def expert_tensors(self) -> dict[int, dict[str, TensorInfo]]:
        """layer -> part ("gate", "up", "down", "gate_bias", ...) -> its [E, ...] tensor."""
        names = expert_names(int(self.config().num_hidden_layers))
        out: dict[int, dict[str, TensorInfo]] = {}
        for name, info in self.ck.tensors.items():
            hit = names.get(name)
            if hit is not None:
                layer, part, suffix = hit
                out.setdefault(layer, {})[part if suffix == "weight" else _BIAS_PARTS[part]] = info
        return out

    def expert_types(self) -> set[str]:
        """GGUF type names of the expert weights ("Q4_K", "Q6_K")."""
        return {type_name(t.ggml_type) for parts in self.expert_tensors().values()
                for p, t in parts.items() if not p.endswith("_bias")}

    def layout(self, adapter: MoeAdapter, dtype: torch.dtype, expert_dtype: str, group_size: int | None,
               requantize: bool = False) -> ExpertLayout:
        """GGUF block rows for ``--expert-dtype auto``; otherwise the adapter's layout (dequantised at load).

        Raises:
            OptionError: int8/int4 on experts that are already quantised, unless ``requantize``.
            CheckpointError: an expert tensor type with no torch dequantiser (names it), or a shape that
                does not match the config.
        """
        if expert_dtype in (q.value for q in ExpertQuant):
            quantised = sorted(t for t in self.expert_types() if t not in {type_name(f) for f in FLOAT_TYPES})
            if quantised and not requantize:
                raise OptionError(f"--expert-dtype {expert_dtype}: the experts of {Path(self.key).name} are already "
                                  f"quantised ({'/'.join(quantised)}) and move packed as they are",
                                  f"drop --expert-dtype (auto keeps them), or add --requantize to dequantise and "
                                  f"quantise them again to {expert_dtype}")
        if expert_dtype != "auto":
            return adapter.layout(dtype, expert_dtype, group_size)
        layers = self._layer_layouts(adapter)
        first = next(iter(layers.values()))
        if all(lay == first for lay in layers.values()):
            return first
        return LayeredLayout(first.hidden, first.intermediate, layers=tuple(sorted(layers.items())))

    def _layer_layouts(self, adapter: MoeAdapter) -> dict[int, GgufLayout]:
        config = adapter.config
        h, i, e = int(config.hidden_size), adapter.expert_intermediate(), adapter.num_experts()
        want = {"gate": (i, h), "up": (i, h), "down": (h, i), "gate_bias": (i,), "up_bias": (i,), "down_bias": (h,)}
        gpt = config.model_type == "gpt_oss"
        names = ("gate", "up", "down", "gate_bias", "up_bias", "down_bias") if gpt else ("gate", "up", "down")
        out = {}
        for layer, tensors in sorted(self.expert_tensors().items()):
            parts = []
            for name in names:
                info = tensors.get(name)
                if info is None:
                    raise CheckpointError(f"{self.ck.files.name}: layer {layer} has no expert tensor for {name}",
                                          "the file is incomplete or not converted by llama.cpp")
                if tuple(info.shape) != (e, *want[name]):
                    raise CheckpointError(f"tensor {info.name} has shape {tuple(info.shape)}, expected {(e, *want[name])}",
                                          "the GGUF's metadata does not match its tensors")
                check_supported(info.ggml_type, f"expert tensor {info.name}")
                parts.append(GgufPart(name, info.ggml_type, want[name]))
            kind = dict(alpha=float(config.swiglu_alpha), limit=float(config.swiglu_limit)) if gpt else {}
            out[layer] = (GgufGptOssLayout if gpt else GgufLayout)(h, i, parts=tuple(parts), **kind)
        return out

    # --- tensors -----------------------------------------------------------------------------
    def tensors(self, adapter: MoeAdapter, layout: ExpertLayout, device: torch.device, dtype: torch.dtype,
                read_experts: bool) -> Iterator[SourceTensor]:
        yield from self._dense_tensors(adapter, device, dtype)
        if not read_experts:
            return
        packed = isinstance(layout, (GgufLayout, LayeredLayout))
        tensors, where = self.expert_tensors(), self.ck.files.name
        if packed:
            yield from self._packed_experts(tensors, where)
        else:
            yield from self._dequantised_experts(adapter, layout, tensors, where)

    def _dense_tensors(self, adapter: MoeAdapter, device: torch.device, dtype: torch.dtype) -> Iterator[SourceTensor]:
        """Dense tensors from the dense cache when it is complete, else dequantised (and cached as they go)."""
        from moespec.runtime.host.checkpoint import iter_tensors

        cache = cache_file(self.folder, dtype)
        plans = dense_plans(self.config(), self.ck.arch, set(self.ck.tensors))
        specs = [(p.name, self._dense_dtype([self.ck.tensors[s] for s in p.sources], dtype), p.shape) for p in plans]
        digests = cached_digests(cache, specs, dtype, self.fingerprint())
        if digests is not None:
            cached = iter_tensors([cache])
            for name, tensor, file in cached:
                if tensor_digest(name, tensor) != digests[name]:  # damaged: dequantised (and cached) again
                    break
                yield SourceTensor(None, adapter.dense_name(name), tensor, file.name, mapped=True)
            else:
                return
            del tensor
            cached.close()  # drops its mapping of the damaged file
            cache.unlink(missing_ok=True)
        writer = DenseCacheWriter(cache, specs, dtype, self.fingerprint())
        try:
            for plan in plans:
                tensor = apply(plan, [self._dense(self.ck.tensors[s], device, dtype) for s in plan.sources])
                writer.write(plan.name, tensor)
                yield SourceTensor(None, adapter.dense_name(plan.name), tensor, self.ck.files.name)
            writer.finish()
            if writer.note is not None:
                self.notes.append(writer.note)
        finally:
            writer.abort()  # a no-op once finished; drops a half-written file when loading stopped

    @staticmethod
    def _dense_dtype(infos: list[TensorInfo], dtype: torch.dtype) -> torch.dtype:
        """What :meth:`_dense` returns for these sources: float32, or ``dtype`` for a large matrix."""
        return dtype if any(len(i.shape) > 1 and math.prod(i.shape) * 4 > DENSE_CHUNK_BYTES for i in infos) else torch.float32

    def _dense(self, info: TensorInfo, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """One dense tensor dequantised on ``device``: float32, or ``dtype`` in row chunks when large."""
        shape = tuple(info.shape)
        rows = shape[0] if len(shape) > 1 else 1
        numel = info.nbytes if not shape else math.prod(shape)
        if self._dense_dtype([info], dtype) == torch.float32:
            return dequantize(self.ck.read(info).to(device), info.ggml_type, shape, torch.float32)
        out = torch.empty(shape, dtype=dtype, device=device)
        step = max(1, DENSE_CHUNK_BYTES // (4 * numel // rows))
        for r in range(0, rows, step):
            n = min(step, rows - r)
            raw = self.ck.read(info, r * info.row_bytes, n * info.row_bytes).to(device)
            out[r : r + n] = dequantize(raw, info.ggml_type, (n, *shape[1:]), dtype)
        return out

    def _packed_experts(self, tensors: dict[int, dict[str, TensorInfo]], where: str) -> Iterator[SourceTensor]:
        """Each expert's bytes of each part, read in chunks of whole experts."""
        for layer, parts in sorted(tensors.items()):
            for part, info in parts.items():
                per = info.row_bytes
                step = max(1, CHUNK_BYTES // per)
                for e0 in range(0, info.shape[0], step):
                    n = min(step, info.shape[0] - e0)
                    buf = self.ck.read(info, e0 * per, n * per).view(n, per)  # [n, bytes of one expert]
                    for k in range(n):
                        yield SourceTensor(ExpertKey(layer, e0 + k, part), info.name, buf[k], where)

    def _dequantised_experts(self, adapter: MoeAdapter, layout: ExpertLayout,
                             tensors: dict[int, dict[str, TensorInfo]], where: str) -> Iterator[SourceTensor]:
        """Experts dequantised to float32 one at a time, in the adapter's parts, through its converter."""
        convert = adapter.expert_converter(layout)
        gpt = adapter.config.model_type == "gpt_oss"
        for layer, parts in sorted(tensors.items()):
            for e in range(parts["gate"].shape[0]):
                w = {p: self._expert_slice(info, e) for p, info in parts.items()}
                if gpt:  # GptOssLayout: gate/up interleaved columns of gate_up [H, 2I], down [I, H]
                    gate_up = torch.stack([w["gate"].T, w["up"].T], dim=-1).flatten(-2)  # [H, 2I]
                    bias = torch.stack([w["gate_bias"], w["up_bias"]], dim=-1).flatten()  # [2I]
                    items = {"gate_up": gate_up, "gate_up_bias": bias, "down": w["down"].T, "down_bias": w["down_bias"]}
                else:
                    items = {p: w[p] for p in ("gate", "up", "down")}
                for part, t in items.items():
                    for k, tensor, name in convert(ExpertKey(layer, e, part), t.contiguous(), parts["gate"].name):
                        yield SourceTensor(k, name, tensor, where)

    def _expert_slice(self, info: TensorInfo, e: int) -> torch.Tensor:
        raw = self.ck.read(info, e * info.row_bytes, info.row_bytes)
        return dequantize(raw, info.ggml_type, tuple(info.shape[1:]), torch.float32)

