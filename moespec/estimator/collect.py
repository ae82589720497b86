"""Training data for the estimators: states and true next-layer routing, streamed to disk in shards.

Shapes: T tokens, H hidden, E experts, K top-k, S served layers, M MoE layers.

A served MoE layer l predicts the next MoE layer l'. Running text through the model in exact mode,
``StateCollector`` (an observer of the MoE runner) records per token:
  state/<l>    [T, H] bf16  the estimator input q = LN_{l'}(r_l + d_l) (input "quasi") or LN_{l'}(r_l) ("router")
  logits/<l>   [T, E] f32   the true router logits of l' (the distillation target)
  ids/<l>      [T, K] i64   the true routing of l' (for recall@K)
  weights/<l>  [T, K] f32   its gate weights (for weighted recall)
Rows are written to ``<split>-NNNNN.safetensors`` shards of about ``SHARD_BYTES`` each, so token counts
beyond RAM work; ``manifest.json`` is written last, so an interrupted collection is never reused.
The held-out split also scores the parameter-free predictors (router, quasi) on the same tokens,
stored in the manifest for the hybrid choice.

Fast path: a training forward ends at the router of the last target layer (``truncate``, the default):
the layers after it, the final norm and the LM head cannot change any recorded row, so they are not
run. The slow reference runs every layer (``truncate=False``); tests compare the two. The held-out
split always runs every layer, because it scores the parameter-free predictors at every layer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from moespec.errors import DataError
from moespec.predict.base import NextLayerPredictor
from moespec.predict.recall import RecallObserver
from moespec.runtime.chunks import Progress, StopForward, run_chunks

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


class StateCollector:
    """Observer for ``MoeLayerRunner.observer``: writes (state of l, true routing of l') rows.

    Args:
        predictor: a RouterPredictor (input "router") or QuasiPredictor (input "quasi") over the model's
            layers; its ``signal`` and the next layer's norm make the state.
        layers: the served layers.
        writer: where rows go.
        stop_early: raise StopForward once the last target layer's routing is recorded, so the rest
            of the model does not run (the rows are the same either way).
    """

    def __init__(self, predictor: NextLayerPredictor, layers: list[int], writer: ShardWriter,
                 stop_early: bool = False) -> None:
        self.predictor = predictor
        self.layers = list(layers)
        self.writer = writer
        self.source_of = {predictor.target(layer).layer: layer for layer in self.layers}  # l' -> l
        self.last_target = max(self.source_of) if stop_early else None
        self._rows: dict[str, torch.Tensor] = {}

    def routing(self, layer: int, x: torch.Tensor, residual: torch.Tensor | None, routing) -> None:
        src = self.source_of.get(layer)
        if src is not None:
            logits = routing.logits
            if logits is None:
                logits = self.predictor.adapter.router_logits(self.predictor.refs[layer].block, x)
            self._rows[f"logits/{src}"] = logits.float()  # [T, E]
            self._rows[f"ids/{src}"] = routing.ids.to(torch.int64)  # [T, K]
            self._rows[f"weights/{src}"] = routing.weights.float()  # [T, K]
        if layer in self.layers and residual is not None:
            nxt = self.predictor.target(layer)
            r = residual.reshape(-1, residual.shape[-1])  # [T, H]
            self._rows[f"state/{layer}"] = nxt.norm(self.predictor.signal(layer, r, routing)).to(torch.bfloat16)
        if layer == self.last_target:
            raise StopForward  # every row of this forward is recorded: skip the layers after it

    def expert_output(self, layer: int, expert: int, token_idx: torch.Tensor, raw_output: torch.Tensor) -> None:
        """Not needed."""

    def end_chunk(self) -> None:
        """Hand the rows of the finished forward pass to the writer."""
        want = len(self.layers) * 4
        if len(self._rows) != want:
            raise DataError(f"a forward pass recorded {len(self._rows)} of {want} estimator tensors",
                            "the runner did not report every served layer; is the model loaded in exact mode?")
        self.writer.add(self._rows)
        self._rows = {}


class _Tee:
    """Forwards observer calls to several observers."""

    def __init__(self, *observers) -> None:
        self.observers = observers

    def routing(self, *args) -> None:
        for o in self.observers:
            o.routing(*args)

    def expert_output(self, *args) -> None:
        for o in self.observers:
            o.expert_output(*args)


def run_collection(om, chunks: list[list[int]], observer, collector: StateCollector, stage: str,
                   progress: Progress | None = None) -> None:
    """Each chunk as an independent prefill with ``observer`` attached; rows handed over per chunk."""
    run_chunks(om, chunks, observer, stage, progress, after_chunk=collector.end_chunk)


def clear_states(folder: Path) -> None:
    """Remove what a previous collection left in ``folder`` (only moespec's own files)."""
    for p in [folder / MANIFEST, folder / VECTORS, *folder.glob("train-*.safetensors"),
              *folder.glob("heldout-*.safetensors")]:
        p.unlink(missing_ok=True)


def collect_states(om, plan, manifest: StatesManifest, predictors: dict[str, NextLayerPredictor], folder: Path,
                   vectors: torch.Tensor | None = None, progress: Progress | None = None,
                   shard_bytes: int = SHARD_BYTES, truncate: bool = True) -> StatesManifest:
    """Run ``plan``'s train and held-out chunks through ``om``; write shards and the manifest to ``folder``.

    Args:
        om: the loaded model (exact mode).
        plan: a ChunkPlan (calib -> train rows, heldout -> held-out rows).
        manifest: identity fields filled in; counts, shards and baseline are filled here.
        predictors: "router" and, with a calibration, "quasi"; the one named ``manifest.input`` makes the states.
        folder: the states folder (created; earlier states in it are removed first).
        vectors: [S, E, H] default vectors of the served layers (input "quasi"), saved beside the shards.
        shard_bytes: bytes of states per shard.
        truncate: end each training forward at the last target layer's router (the fast path);
            False runs every layer (the slow reference). Both write the same rows.
    """
    from moespec.tempfiles import lock_fd
    from moespec.fsutil import check_free_space

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lock = lock_fd(folder)  # `moespec models --clean` leaves a collection that runs alone
    try:
        clear_states(folder)  # what a killed collection left
        check_free_space(folder, states_bytes(plan, manifest))  # said before the collection, not after it
        return _collect(om, plan, manifest, predictors, folder, vectors, progress, shard_bytes, truncate)
    except BaseException:  # Ctrl-C, a full disk: shards without a manifest are never reused, so go now
        clear_states(folder)
        with contextlib.suppress(OSError):
            folder.rmdir()
        raise
    finally:
        if lock is not None:
            os.close(lock)


def _collect(om, plan, manifest: StatesManifest, predictors: dict[str, NextLayerPredictor], folder: Path,
             vectors: torch.Tensor | None, progress: Progress | None, shard_bytes: int,
             truncate: bool) -> StatesManifest:
    maker = predictors[manifest.input]
    with torch.inference_mode():
        train = ShardWriter(folder, "train", shard_bytes)
        collector = StateCollector(maker, manifest.layers, train, stop_early=truncate)
        run_collection(om, plan.calib, collector, collector, "collect", progress)
        train.flush()
        held = ShardWriter(folder, "heldout", shard_bytes)
        collector = StateCollector(maker, manifest.layers, held)
        scorer = RecallObserver(om.adapter, predictors)
        run_collection(om, plan.heldout, _Tee(collector, scorer), collector, "heldout", progress)
        held.flush()
    if vectors is not None:
        save_vectors(folder, vectors)
    manifest.tokens, manifest.heldout_tokens = train.rows, held.rows
    manifest.shards = {"train": train.names, "heldout": held.names}
    manifest.baseline = baseline_recall(scorer, maker, manifest.moe_layers)
    write_manifest(folder, manifest)
    return manifest


def write_manifest(folder: Path, manifest: StatesManifest) -> None:
    """Write ``folder``'s manifest atomically, with the XXH3-128 of its JSON (integrity.seal_json)."""
    from moespec.fsutil import atomic_write_text
    from moespec.integrity import seal_json

    atomic_write_text(Path(folder) / MANIFEST, json.dumps(seal_json(asdict(manifest)), indent=1, allow_nan=True))


def states_bytes(plan, manifest: StatesManifest) -> int:
    """Bytes the states of ``plan``'s chunks take on disk: per token and served layer a bf16 state [H],
    the true logits [E] (f32), ids [K] (i64) and weights [K] (f32)."""
    tokens = sum(len(c) for c in [*plan.calib, *plan.heldout])
    row = manifest.hidden * 2 + manifest.experts * 4 + manifest.top_k * 12
    return tokens * len(manifest.layers) * row


def baseline_recall(scorer, predictor: NextLayerPredictor, moe_layers: list[int]) -> dict[str, list[float]]:
    """"<metric>/<name>" -> [M] recall per *source* layer l (the layer that predicts), NaN where none."""
    out = {}
    for name, per_target in scorer.counts.items():
        for metric in ("recall", "weighted_recall"):
            vals = []
            for layer in moe_layers:
                nxt = predictor.target(layer)
                c = per_target.get(nxt.layer) if nxt is not None else None
                vals.append(getattr(c, metric)() if c is not None else math.nan)
            out[f"{metric}/{name}"] = vals
    return out


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
