"""The estimator file: safetensors tensors + one JSON metadata entry, written atomically.

Shapes: S served layers, M MoE layers, E experts, H hidden.

Tensors:
  bank/<name>            the EstimatorBank's weights (fp32)
  layers                 [S] int64     served decoder layers l (each predicts the next MoE layer)
  moe_layers             [M] int64     every MoE layer of the model
  vectors                [S, E, H] f32 default vectors of the served layers (input "quasi" only), so the
                                       estimator input does not change when the model is calibrated again
  recall/<predictor>     [M] f32       held-out recall@K per source layer (router, quasi, estimator; NaN = none)
  weighted_recall/<p>    [M] f32       true gate mass covered
  cost_ms/<predictor>    [M] f32       measured cost per decode token of the prediction made at that layer
Metadata (key "moespec", JSON): format, version, model, config hash, router fingerprint, shape (H, E, m,
n, shared), input ("quasi" or "router"), choice (source layer -> predictor, for `hybrid`), margin and
link of the choice, training tokens, held-out tokens, training settings, data description, seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from moespec.artifacts import describe_estimator
from moespec.errors import CalibrationError, OutputError
from moespec.fsutil import load_safetensors_with_meta, save_safetensors_atomic
from moespec.predict.calibration_file import config_hash
from moespec.predict.estimator_net import EstimatorBank, EstimatorShape

FORMAT = "moespec.estimator"
FORMAT_VERSION = 1
META_KEY = "moespec"
PREDICTORS = ("router", "quasi", "estimator")
METRICS = ("recall", "weighted_recall", "cost_ms")


@dataclass
class EstimatorFile:
    """Trained estimators and the hybrid choice of one model.

    Attributes:
        bank: the estimators (their ``layers`` are the served layers).
        moe_layers: every MoE layer (M).
        input: "quasi" or "router" (what the estimators read).
        vectors: [S, E, H] default vectors of the served layers (input "quasi"), else None.
        choice: source MoE layer -> "router" | "quasi" | "estimator" (every layer that has a next one).
        metrics: "<metric>/<predictor>" -> [M] float32 (metric in METRICS).
        meta: JSON-able metadata (model, config_hash, router_fingerprint, tokens, ...).
    """

    bank: EstimatorBank
    moe_layers: list[int]
    input: str
    vectors: torch.Tensor | None
    choice: dict[int, str]
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    @property
    def layers(self) -> list[int]:
        """The served layers."""
        return list(self.bank.layers)

    def metric(self, metric: str, predictor: str, layer: int) -> float:
        """One value (NaN when absent)."""
        t = self.metrics.get(f"{metric}/{predictor}")
        return float(t[self.moe_layers.index(layer)]) if t is not None else float("nan")

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {f"bank/{k}": v.float() for k, v in self.bank.state_dict().items()}
        out["layers"] = torch.tensor(self.layers, dtype=torch.int64)
        out["moe_layers"] = torch.tensor(self.moe_layers, dtype=torch.int64)
        if self.vectors is not None:
            out["vectors"] = self.vectors.float()
        out.update({k: v.float() for k, v in self.metrics.items()})
        return {k: v.detach().cpu().contiguous() for k, v in out.items()}


def save_estimator(path: str | Path, ef: EstimatorFile) -> Path:
    """Write ``ef`` to ``path`` atomically (an interrupted write leaves no partial file).

    Raises:
        OutputError: the path is not writable.
    """
    meta = dict(ef.meta, format=FORMAT, format_version=FORMAT_VERSION, input=ef.input,
                shape=ef.bank.shape.to_dict(), choice={str(k): v for k, v in sorted(ef.choice.items())})
    path = Path(path).expanduser()
    if path.is_dir():
        raise OutputError(f"--out {path} is a folder", "pass a file path, e.g. --out estimators.safetensors")
    return save_safetensors_atomic(path, ef.tensors(), meta, META_KEY)


def load_estimator(path: str | Path, flag: str | None = None) -> EstimatorFile:
    """Read an estimator file (weights on the CPU, fp32).

    Args:
        path: the file.
        flag: the CLI flag the path came from (e.g. "--estimator"), named in errors; None = found automatically.

    Raises:
        CalibrationError: missing, unreadable, corrupt, not an estimator file, or a newer format.
    """
    path = Path(path).expanduser()
    name = describe_estimator(path, flag)
    redo = f"run `moespec train-estimator MODEL --out {path}` to write it again"
    meta, tensors = load_safetensors_with_meta(
        path, "estimator", FORMAT, FORMAT_VERSION, META_KEY, name=name,
        missing=(f"{name} does not exist", "run `moespec train-estimator MODEL` to make one"),
        redo=redo, again="train the estimators again", nan_ok=tuple(f"{m}/" for m in METRICS))
    try:
        bank = EstimatorBank(EstimatorShape(**meta["shape"]), [int(x) for x in tensors["layers"].tolist()])
        bank.load_state_dict({k[len("bank/"):]: v for k, v in tensors.items() if k.startswith("bank/")})
        ef = EstimatorFile(
            bank=bank.eval(),
            moe_layers=[int(x) for x in tensors["moe_layers"].tolist()],
            input=meta["input"],
            vectors=tensors.get("vectors"),
            choice={int(k): v for k, v in meta["choice"].items()},
            metrics={k: v for k, v in tensors.items() if k.split("/", 1)[0] in METRICS},
            meta=meta,
        )
    except (KeyError, TypeError, RuntimeError) as exc:
        raise CalibrationError(f"{name} is an incomplete or inconsistent estimator file ({exc})", redo) from None
    return ef


def check_matches(ef: EstimatorFile, path: Path, config, moe_layers: list[int], fingerprint: str | None,
                  model: str = "MODEL", flag: str | None = None) -> None:
    """Refuse an estimator file made for another model.

    Args:
        ef, path: the loaded file and where it came from.
        config, moe_layers, fingerprint: the running model (fingerprint None = not compared).
        model: how the hint names the model.
        flag: the CLI flag the path came from (e.g. "--estimator"), named in errors; None = found automatically.

    Raises:
        CalibrationError: config hash, MoE layers, sizes or router weights differ.
    """
    made_for = ef.meta.get("model", "another model")
    name = describe_estimator(path, flag)
    hint = f"run `moespec train-estimator {model}` to train estimators for this model"
    if flag:
        hint = f"pass this model's estimator file with {flag}, or drop {flag} and {hint}"
    want = config_hash(config)
    if ef.meta.get("config_hash") != want:
        raise CalibrationError(f"{name} was made for {made_for} (config hash "
                               f"{ef.meta.get('config_hash')}), not this model (config hash {want})", hint)
    if ef.moe_layers != list(moe_layers) or ef.bank.shape.hidden != int(getattr(config, "hidden_size", ef.bank.shape.hidden)):
        raise CalibrationError(f"{name} covers MoE layers {ef.moe_layers}, this model has {list(moe_layers)}", hint)
    if fingerprint is not None and ef.meta.get("router_fingerprint") not in (None, fingerprint):
        raise CalibrationError(f"{name} was made for {made_for}, whose router weights differ from this "
                               "model's (same architecture, other weights: a fine-tune or another revision?)", hint)
