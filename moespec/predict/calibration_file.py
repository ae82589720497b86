"""The calibration file: safetensors tensors + one JSON metadata entry, written atomically.

Shapes: M MoE layers, E experts, H hidden.

Tensors:
  layers                      [M] int64     decoder-layer index of each MoE layer
  default_vectors             [M, E, H] f32 the chosen variant (metadata "variant")
  default_vectors/<variant>   [M, E, H] f32 each other variant ("mean", "gate_weighted")
  frequencies                 [M, E] int64  top-K memberships over the calibration tokens
  unrouted                    [M] int64     experts never routed (their vector is the layer mean)
  recall/<predictor>          [M] f32       recall@K predicting layer m from the MoE layer before it
  weighted_recall/<predictor> [M] f32       true gate mass covered (NaN for the first MoE layer)
  cosine/<predictor>          [M] f32       mean cos(LN(signal), true router input)
Predictors: "router", "quasi" (the chosen variant) and "quasi_<variant>" for each variant.

Metadata (key "moespec", JSON): format version, model, config hash, router fingerprint, moespec
version, token counts, sequence length, seed, data descriptions, chosen variant. No clock time,
so the same data, seed and model give a byte-identical file.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moespec.artifacts import model_key
from moespec.errors import CalibrationError, OutputError
from moespec.fsutil import load_safetensors_with_meta, save_safetensors_atomic

FORMAT = "moespec.calibration"
FORMAT_VERSION = 1
META_KEY = "moespec"

# config.json fields that define what the default vectors depend on; stable across transformers
# versions (to_dict() grows new defaults with every release, which would change a full-dict hash).
HASHED_FIELDS = (
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "intermediate_size", "moe_intermediate_size",
    "shared_expert_intermediate_size", "num_experts", "num_local_experts", "num_experts_per_tok",
    "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "first_k_dense_replace",
    "rms_norm_eps", "hidden_act", "tie_word_embeddings",
)


def config_hash(config) -> str:
    """A short stable hash (16 hex digits) of a model config's architecture fields.

    Args:
        config: a transformers config, or a dict as in config.json.
    """
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    fields = {k: get(k) for k in HASHED_FIELDS if get(k) is not None}
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def router_fingerprint(router_weights: list[torch.Tensor]) -> str:
    """A short hash of the MoE routers' weights [E, H] (rounded to bfloat16, so the dtype they
    were loaded in does not matter): tells a fine-tune from its base model, which share a config."""
    h = hashlib.sha256()
    for w in router_weights:
        h.update(w.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]


@dataclass
class Calibration:
    """A calibration: default vectors, frequencies, per-layer recall, and where they came from.

    Attributes:
        layers: decoder-layer index of each MoE layer (length M).
        default_vectors: variant -> [M, E, H] float32.
        variant: the variant chosen by held-out recall (``default_vectors[variant]`` is used).
        frequencies: [M, E] int64.
        unrouted: [M] int64.
        metrics: "<metric>/<predictor>" -> [M] float32 (metric: recall, weighted_recall, cosine).
        meta: JSON-able metadata (model, config_hash, router_fingerprint, tokens, ...).
    """

    layers: list[int]
    default_vectors: dict[str, torch.Tensor]
    variant: str
    frequencies: torch.Tensor
    unrouted: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    @property
    def vectors(self) -> torch.Tensor:
        """[M, E, H] default vectors of the chosen variant."""
        return self.default_vectors[self.variant]

    def metric(self, metric: str, predictor: str) -> torch.Tensor:
        """[M] values of ``metric`` (recall, weighted_recall, cosine) for ``predictor`` (NaN where none)."""
        return self.metrics[f"{metric}/{predictor}"]

    def predictors(self) -> list[str]:
        """Predictor names with metrics, e.g. ["quasi", "quasi_gate_weighted", "quasi_mean", "router"]."""
        return sorted({k.split("/", 1)[1] for k in self.metrics})

    def tensors(self) -> dict[str, torch.Tensor]:
        """Everything as named contiguous CPU tensors (the file's content)."""
        out = {
            "layers": torch.tensor(self.layers, dtype=torch.int64),
            "default_vectors": self.vectors,
            "frequencies": self.frequencies.to(torch.int64),
            "unrouted": self.unrouted.to(torch.int64),
        }
        out.update({f"default_vectors/{k}": v for k, v in self.default_vectors.items() if k != self.variant})
        out.update(self.metrics)
        return {k: v.detach().cpu().contiguous() for k, v in out.items()}


def ensure_writable(path: str | Path) -> Path:
    """Check early (before a long run) that ``path`` can be written.

    Raises:
        OutputError: its folder cannot be created or written, or the path is a folder.
    """
    import tempfile

    path = Path(path).expanduser()
    if path.is_dir():
        raise OutputError(f"--out {path} is a folder", "pass a file path, e.g. --out calib.safetensors")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}", "choose a writable --out path") from exc
    return path


def save_calibration(path: str | Path, calib: Calibration) -> Path:
    """Write ``calib`` to ``path`` atomically (an interrupted write leaves no partial file).

    Raises:
        OutputError: the path is not writable.
    """
    meta = dict(calib.meta, format=FORMAT, format_version=FORMAT_VERSION, variant=calib.variant)
    return save_safetensors_atomic(Path(path).expanduser(), calib.tensors(), meta, META_KEY)


def load_calibration(path: str | Path) -> Calibration:
    """Read a calibration file.

    Raises:
        CalibrationError: missing, unreadable, corrupt, not a calibration file, or a newer format.
    """
    path = Path(path).expanduser()
    redo = f"run `moespec calibrate MODEL --out {path}` to write it again"
    meta, tensors = load_safetensors_with_meta(
        path, "calibration", FORMAT, FORMAT_VERSION, META_KEY, name=str(path),
        missing=(f"calibration file {path} does not exist", "run `moespec calibrate MODEL` to make one"),
        redo=redo, again="calibrate again", nan_ok=("recall/", "weighted_recall/", "cosine/"))
    try:
        variants = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("default_vectors/")}
        variants[meta["variant"]] = tensors["default_vectors"]
        calib = Calibration(
            layers=[int(x) for x in tensors["layers"].tolist()],
            default_vectors=variants,
            variant=meta["variant"],
            frequencies=tensors["frequencies"],
            unrouted=tensors["unrouted"],
            metrics={k: v for k, v in tensors.items() if k.split("/", 1)[0] in ("recall", "weighted_recall", "cosine")},
            meta=meta,
        )
    except KeyError as exc:
        raise CalibrationError(f"{path} lacks {exc.args[0]!r}: an incomplete calibration file", redo) from None
    return calib


def check_matches(calib: Calibration, path: Path, config, layers: list[int], fingerprint: str | None,
                  model: str = "MODEL") -> None:
    """Refuse a calibration made for another model.

    Args:
        calib: the loaded calibration (from ``path``).
        config: the running model's config.
        layers: the running model's MoE layer indices.
        fingerprint: its router fingerprint (None = skip that check).
        model: how the running model is named in the hint.

    Raises:
        CalibrationError: config hash, MoE layers, default-vector shape or router weights differ.
    """
    made_for = calib.meta.get("model", "another model")
    hint = f"run `moespec calibrate {model}` to calibrate this model"
    want = config_hash(config)
    if calib.meta.get("config_hash") != want:
        raise CalibrationError(f"calibration file {path} was made for {made_for} (config hash "
                               f"{calib.meta.get('config_hash')}), not this model (config hash {want})", hint)
    hidden = int(getattr(config, "hidden_size", calib.vectors.shape[-1]))
    if calib.layers != list(layers) or calib.vectors.shape[-1] != hidden:
        raise CalibrationError(f"calibration file {path} covers MoE layers {calib.layers}, this model has {list(layers)}", hint)
    if fingerprint is not None and calib.meta.get("router_fingerprint") not in (None, fingerprint):
        raise CalibrationError(f"calibration file {path} was made for {made_for}, whose router weights differ from this "
                               "model's (same architecture, other weights: a fine-tune or another revision?)", hint)


def load_checked(path: Path, config, layers: list[int], routers: list[torch.Tensor] | None,
                 model_path: str | Path) -> Calibration:
    """Load the calibration file at ``path`` and refuse it unless it was made for the running model.

    The one check every reader of a calibration file runs (quasi predictor, seeded cache policies,
    estimator training), so they cannot drift apart.

    Args:
        path: the calibration file (safetensors).
        config: the running model's config.
        layers: its MoE decoder-layer indices, in order.
        routers: its router weights, [E, H] each in ``layers`` order (None: skip the fingerprint check).
        model_path: the model's folder or name, as the hint's `moespec calibrate MODEL` names it.

    Raises:
        CalibrationError: unreadable file, or made for another model (check_matches).
    """
    calib = load_calibration(path)
    fingerprint = router_fingerprint(routers) if routers else None
    check_matches(calib, path, config, list(layers), fingerprint, model_key(model_path))
    return calib


def finite_mean(values: torch.Tensor) -> float:
    """Mean of the finite entries of a [M] metric (NaN when there are none)."""
    vals = [float(v) for v in values.tolist() if not math.isnan(float(v))]
    return sum(vals) / len(vals) if vals else float("nan")
