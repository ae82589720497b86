"""GGUF models and the Hub: `moespec download REPO --quant Q4_K_M`, and the sizes of `moespec models`'
GGUF rows (the rows themselves: moespec.hub.listing).

A Hub GGUF repo holds one file set per quant type (a file, or split parts, sometimes in a folder
named after the quant). ``--quant`` picks one set: only its parts are fetched (plus README and
license), through the same planned download as safetensors (moespec.hub.download). Listing reads
the local Hub cache (no network; a snapshot without config.json) and the folders moespec prepared; a model's architecture and
sizes come from its prepared folder when there is one, else from its first part's header.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from moespec.errors import CheckpointError
from moespec.gguf.files import GgufFiles, models_in, select_quant


def plan_gguf_download(repo_id: str, quant: str, revision: str | None = None, token: str | None = None,
                       local_dir: Path | None = None):
    """A DownloadPlan (moespec.hub.download) of one quant's file set; no weights move.

    Raises:
        HubUnreachableError, HubAccessError, ModelNotFoundError, CheckpointError: as plan_download, or no such quant.
    """
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    from moespec.hub.checkpoint_files import CheckpointFiles
    from moespec.hub.download import DownloadPlan, _cached_files, _hub_call

    api = HfApi(token=token)
    info = _hub_call(lambda: api.model_info(repo_id, revision=revision), repo_id, revision)
    commit = str(info.sha)
    tree = _hub_call(lambda: list(api.list_repo_tree(repo_id, revision=commit, recursive=True)), repo_id, revision)
    file_bytes = {f.path: int(f.size) for f in tree if isinstance(f, RepoFile)}
    weights = select_quant(list(file_bytes), repo_id, quant)
    meta = [p for p in file_bytes if "/" not in p and p.upper().startswith(("README", "LICENSE"))]
    files = CheckpointFiles(meta=sorted(meta), weights=weights,
                            skipped=sorted(p for p in file_bytes if p not in set(meta) | set(weights)))
    return DownloadPlan(repo_id=repo_id, revision=revision or "main", commit=commit, files=files,
                        file_bytes={f: file_bytes[f] for f in files.wanted},
                        cached=_cached_files(repo_id, commit, files.wanted, local_dir), config={}, sizes=None,
                        local_dir=local_dir)


@dataclass(frozen=True)
class GgufSizes:
    """What `moespec models` shows for a GGUF model (duck-typed as moespec.hub.sizes.ModelSizes).

    Attributes:
        dtype: the compute dtype it implies; expert_format: "gguf Q4_K/Q4_K/Q6_K".
        expert_bytes: one row, the largest layer's; moe_layers, num_experts, top_k: its shape.
        layer_bytes: per MoE layer, what one copy moves (less than a row where layers mix quant types).
        dense_bytes: the dense part dequantised to ``dtype``.
        quant: the file's quant label ("Q4_K_M"), or "".
    """

    model_type: str
    dtype: str
    expert_format: str
    expert_bytes: int
    moe_layers: int
    num_experts: int
    top_k: int
    dense_bytes: int
    group_size: int = 0
    quant: str = ""
    layer_bytes: tuple[int, ...] = ()

    @property
    def experts_bytes(self) -> int:
        return self.expert_bytes * self.num_experts * self.moe_layers

    @property
    def host_ram_bytes(self) -> int:
        from moespec.hub.sizes import HOST_HEADROOM_BYTES

        return self.experts_bytes + HOST_HEADROOM_BYTES

    @property
    def host_ram_cpu_bytes(self) -> int:
        return self.host_ram_bytes + self.dense_bytes

    @property
    def zero_cache_h2d_bytes_per_token(self) -> int:
        return self.top_k * (sum(self.layer_bytes) or self.moe_layers * self.expert_bytes)

    @property
    def from_disk_min_ram_bytes(self) -> int:
        from moespec.hub.sizes import from_disk_min_ram

        return from_disk_min_ram(self.dense_bytes, self.top_k, self.expert_bytes)

    def runs_from_disk(self, available_ram: int) -> bool:
        return self.host_ram_cpu_bytes > available_ram


def gguf_sizes(ck, config: dict) -> GgufSizes:
    """Sizes of the GGUF model ``ck`` (a GgufCheckpoint) whose transformers config is ``config``."""
    from moespec.gguf.dequant import type_name
    from moespec.gguf.layout import ALIGN
    from moespec.gguf.names import expert_names

    experts = expert_names(int(config["num_hidden_layers"]))
    rows: dict[int, int] = {}
    types: dict[str, set] = {}
    num = 0
    for name, info in ck.tensors.items():
        hit = experts.get(name)
        if hit:
            rows[hit[0]] = rows.get(hit[0], 0) + -(-info.row_bytes // ALIGN) * ALIGN
            num = info.shape[0]
            if hit[2] == "weight":
                types.setdefault(hit[1], set()).add(type_name(info.ggml_type))
    dense = sum(math.prod(i.shape) for n, i in ck.tensors.items() if n not in experts)
    dtype = str(config.get("dtype") or "bfloat16")
    fmt = "gguf " + "/".join("+".join(sorted(types.get(p, {"?"}))) for p in ("gate", "up", "down"))
    return GgufSizes(model_type=str(config.get("model_type", "")), dtype=dtype, expert_format=fmt,
                     expert_bytes=max(rows.values(), default=0), moe_layers=len(rows), num_experts=num,
                     top_k=int(config.get("num_experts_per_tok", 0)),
                     dense_bytes=dense * (4 if dtype == "float32" else 2), layer_bytes=tuple(rows[k] for k in sorted(rows)))


def hub_gguf_sets(snapshot: Path) -> list[GgufFiles]:
    """The GGUF models in a Hub cache snapshot (none when it is a transformers checkpoint)."""
    if (snapshot / "config.json").is_file():
        return []
    try:
        return models_in(snapshot)
    except CheckpointError:  # an interrupted download: a split part missing
        return []


def describe_gguf(files: GgufFiles, key: str):
    """(model_type, GgufSizes | None, status) of a GGUF model: from its prepared folder when current,
    else from its first part's header; status "ok", "unsupported" or "incomplete"."""
    import json

    from moespec.errors import MoespecError
    from moespec.gguf.config import hf_config_dict
    from moespec.gguf.reader import GgufCheckpoint
    from moespec.gguf.sidecar import default_dtype, is_current, read_marker, sidecar_dir

    folder = sidecar_dir(key)
    data = read_marker(folder)
    try:
        if data is not None and data.get("key") == key and is_current(data, files):
            ck = GgufCheckpoint.from_json(data["checkpoint"])
            config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        else:
            ck = GgufCheckpoint.open(files)
            config = {**hf_config_dict(ck), "dtype": default_dtype(ck)}
    except MoespecError as exc:  # a cut-off file, or an architecture moespec does not run
        return "?", None, "incomplete" if isinstance(exc, CheckpointError) else "unsupported"
    except (OSError, ValueError, KeyError):
        return "?", None, "incomplete"
    return str(config.get("model_type", "?")), replace(gguf_sizes(ck, config), quant=files.quant), "ok"
