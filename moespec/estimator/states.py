"""The estimator states folder on disk: its manifest, shards and default vectors (written and read).

Files in a states folder (written by estimator/collect.py, read by estimator/train.py and run.py):
  manifest.json               StatesManifest as JSON with its XXH3-128 (integrity.seal_json),
                              written last, so a folder without it is never reused
  <split>-NNNNN.safetensors   rows of one split ("train" / "heldout"), key -> [T, ...]
                              (state/<l> bf16 [T, H], logits/<l> f32 [T, E], ids/<l> i64 [T, K],
                              weights/<l> f32 [T, K]), each tensor with its own checksum
  vectors.safetensors         the [S, E, H] default vectors (input "quasi"), with their checksum
Every reader checks what it reads (truncation, checksums, NaN/Inf) and raises DataError.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from moespec.errors import DataError

SHARD_BYTES = 256 * 2**20  # state bytes per shard (bf16); a shard is loaded whole while training
MANIFEST = "manifest.json"
VECTORS = "vectors.safetensors"
FORMAT = "moespec.estimator-states"
FORMAT_VERSION = 1


@dataclass
class StatesManifest:
    """What a states folder holds and what it was collected from.

    Attributes:
        model, config_hash, router_fingerprint: the model it belongs to.
        moe_layers: every MoE layer (M), in order.
        layers: the served layers l (S); ``targets[i]`` is the MoE layer that ``layers[i]`` predicts.
        input: "quasi" (q = LN(r + d), needs default vectors) or "router" (LN(r)).
        hidden, experts, top_k: H, E, K.
        tokens, heldout_tokens: rows in the train / held-out shards.
        seq_len, data: how the text was cut and where it came from.
        shards: split -> shard file names.
        baseline: "<metric>/<predictor>" -> [M] per source layer (NaN where none), on the held-out tokens.
    """

    model: str
    config_hash: str
    router_fingerprint: str
    moe_layers: list[int]
    layers: list[int]
    targets: list[int]
    input: str
    hidden: int
    experts: int
    top_k: int
    tokens: int = 0
    heldout_tokens: int = 0
    seq_len: int = 0
    data: str = ""
    shards: dict[str, list[str]] = field(default_factory=lambda: {"train": [], "heldout": []})
    baseline: dict[str, list[float]] = field(default_factory=dict)
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    def identity(self) -> tuple:
        """What must match for states to be reused."""
        return (self.config_hash, self.router_fingerprint, self.layers, self.input)


def vectors_digest(vectors: torch.Tensor | None) -> str:
    """Short hash of the default vectors used for the states (empty for input "router")."""
    if vectors is None:
        return ""
    return hashlib.sha256(vectors.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


class ShardWriter:
    """Appends rows per key and writes a shard whenever about ``shard_bytes`` of states piled up.

    Args:
        folder: the states folder.
        split: "train" or "heldout".
        shard_bytes: bytes of states per shard.
    """

    def __init__(self, folder: Path, split: str, shard_bytes: int = SHARD_BYTES) -> None:
        self.folder, self.split, self.shard_bytes = Path(folder), split, shard_bytes
        self.names: list[str] = []
        self.rows = 0  # rows written, over all shards
        self._parts: dict[str, list[torch.Tensor]] = {}
        self._bytes = 0
        self._pending_rows = 0

    def add(self, rows: dict[str, torch.Tensor]) -> None:
        """Rows of one chunk: key -> [T, ...] (the same T for every key)."""
        lengths = {v.shape[0] for v in rows.values()}
        if len(lengths) != 1:
            raise ValueError(f"rows of unequal length {sorted(lengths)}")
        for k, v in rows.items():
            self._parts.setdefault(k, []).append(v.detach().cpu())
            if k.startswith("state/"):
                self._bytes += v.numel() * v.element_size()
        self._pending_rows += lengths.pop()
        if self._bytes >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        """Write the piled-up rows as one shard (nothing when empty)."""
        from safetensors.torch import save_file

        from moespec.fsutil import atomic_path
        from moespec.integrity import per_tensor_digests

        if not self._pending_rows:
            return
        name = f"{self.split}-{len(self.names):05d}.safetensors"
        tensors = {k: torch.cat(v).contiguous() for k, v in self._parts.items()}
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        with atomic_path(self.folder / name, size=size) as tmp:
            save_file(tensors, str(tmp), metadata=per_tensor_digests(tensors))  # load_shard checks what it reads
        self.names.append(name)
        self.rows += self._pending_rows
        self._parts, self._bytes, self._pending_rows = {}, 0, 0


def load_shard(path: Path, layers: list[int], keys: tuple[str, ...] = ("state", "logits", "ids", "weights"),
               device: torch.device | str = "cpu") -> dict[str, dict[int, torch.Tensor]]:
    """key -> layer -> rows of one shard (only the keys and layers asked for), checked against the
    shard's checksums.

    Raises:
        DataError: the shard is truncated, unreadable, or its data differs from its checksums.
    """
    from safetensors import SafetensorError, safe_open

    from moespec.integrity import mismatched, nonfinite, safetensors_damage

    redo = "drop --reuse-states to collect the states again"
    damage = safetensors_damage(Path(path))
    if damage is not None:
        raise DataError(f"states shard {path} is {damage}", redo)
    out: dict[str, dict[int, torch.Tensor]] = {k: {} for k in keys}
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            read = {f"{k}/{layer}": f.get_tensor(f"{k}/{layer}") for k in keys for layer in layers}
            bad = mismatched(f.metadata(), read)
    except (SafetensorError, OSError) as exc:
        raise DataError(f"states shard {path} is not readable ({exc})", redo) from exc
    if bad or (bad := nonfinite(read)):
        raise DataError(f"states shard {path} is corrupt: {bad[0]} does not match its checksum or is not finite", redo)
    for name, t in read.items():
        k, layer = name.rsplit("/", 1)
        out[k][int(layer)] = t.to(device)
    return out


def clear_states(folder: Path) -> None:
    """Remove what a previous collection left in ``folder`` (only moespec's own files)."""
    for p in [folder / MANIFEST, folder / VECTORS, *folder.glob("train-*.safetensors"),
              *folder.glob("heldout-*.safetensors")]:
        p.unlink(missing_ok=True)


def write_manifest(folder: Path, manifest: StatesManifest) -> None:
    """Write ``folder``'s manifest atomically, with the XXH3-128 of its JSON (integrity.seal_json)."""
    from moespec.fsutil import atomic_write_text
    from moespec.integrity import seal_json

    atomic_write_text(Path(folder) / MANIFEST, json.dumps(seal_json(asdict(manifest)), indent=1, allow_nan=True))


def read_manifest(folder: Path) -> StatesManifest | None:
    """The manifest of a finished collection in ``folder`` (None when there is none).

    Raises:
        DataError: the manifest is unreadable or of a newer format.
    """
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        from moespec.integrity import open_json

        raw, intact = open_json(json.loads(path.read_text(encoding="utf-8")))
        if intact is False:  # its "xxh3" field differs from the rest: damaged like a cut file
            raise ValueError("its checksum does not match its contents")
        if raw.get("format") != FORMAT or int(raw.get("format_version", 0)) > FORMAT_VERSION:
            raise ValueError(f"format {raw.get('format')!r} version {raw.get('format_version')}")
        manifest = StatesManifest(**raw)
    except (ValueError, TypeError, OSError) as exc:
        raise DataError(f"{path} is not a readable moespec states manifest ({exc})",
                        "drop --reuse-states to collect the states again") from exc
    missing = [n for names in manifest.shards.values() for n in names if not (Path(folder) / n).is_file()]
    if missing:
        raise DataError(f"states folder {folder} lacks {len(missing)} shard(s), e.g. {missing[0]}",
                        "drop --reuse-states to collect the states again")
    from moespec.integrity import safetensors_damage

    for name in [n for names in manifest.shards.values() for n in names]:
        if (damage := safetensors_damage(Path(folder) / name)) is not None:  # said now, not mid-training
            raise DataError(f"states shard {Path(folder) / name} is {damage}", "drop --reuse-states to collect the states again")
    return manifest


def save_vectors(folder: Path, vectors: torch.Tensor) -> None:
    """Write the [S, E, H] default vectors beside the states (float32, with their checksum), atomically."""
    from safetensors.torch import save_file

    from moespec.fsutil import atomic_path
    from moespec.integrity import digest_metadata

    with atomic_path(Path(folder) / VECTORS) as tmp:
        tensors = {"vectors": vectors.float().cpu().contiguous()}
        save_file(tensors, str(tmp), metadata=digest_metadata(tensors))


def read_vectors(folder: Path) -> torch.Tensor | None:
    """[S, E, H] default vectors saved with the states (None for input "router").

    Raises:
        DataError: the file is damaged (truncated, checksum, NaN/Inf).
    """
    from safetensors import SafetensorError, safe_open

    from moespec.integrity import nonfinite, safetensors_damage, verify_digest

    path = Path(folder) / VECTORS
    if not path.is_file():
        return None
    damage = safetensors_damage(path)
    try:
        if damage is None:
            with safe_open(str(path), framework="pt") as f:
                tensors = {"vectors": f.get_tensor("vectors")}
                if verify_digest(f.metadata(), tensors) is False or nonfinite(tensors):
                    damage = "corrupt: its data does not match its checksum or is not finite"
    except (SafetensorError, OSError) as exc:
        damage = f"unreadable ({exc})"
    if damage is not None:
        raise DataError(f"{path} is {damage}", "drop --reuse-states to collect the states again")
    return tensors["vectors"]
