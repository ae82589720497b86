"""Distilling the estimators: KL to the true router's softmax, AdamW, cosine schedule, early stop.

Shapes: B batch tokens, H hidden, E experts, K top-k, S served layers.

Every step takes the same B token rows for every served layer from one train shard and minimises
mean over layers of KL(softmax(z_true) || softmax(z_est)). Per-layer networks are independent
parameters under one AdamW, so this is S independent trainings sharing a schedule; a shared network
sees every layer's batch through its layer embedding. Every ``eval_every`` steps, recall@K on the first
``eval_tokens`` held-out rows decides which weights are kept (per layer for per-layer networks, by
the mean for a shared one); training stops after ``patience`` evaluations without improvement. The
reported recall is measured afterwards on every held-out row.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from moespec.estimator.states import StatesManifest, load_shard
from moespec.predict.estimator_net import EstimatorBank

# Served layer l, logits [T, E] -> predicted expert ids [T, K] by the next layer's routing rule.
Select = Callable[[int, torch.Tensor], torch.Tensor]
# (step, total steps, loss, mean held-out recall or NaN) after every step.
TrainProgress = Callable[[int, int, float, float], None]


@dataclass(frozen=True)
class TrainConfig:
    """Training settings, defaults in one place.

    Attributes:
        epochs: passes over the train shards (at most; early stopping may end sooner).
        batch_tokens: B rows per step and layer.
        lr: peak AdamW learning rate (linear warm-up, then cosine to ``lr * min_lr_ratio``).
        weight_decay: AdamW decoupled weight decay.
        warmup_frac: fraction of the steps spent warming up.
        min_lr_ratio: the cosine's floor.
        eval_every: steps between held-out evaluations (0 = once per shard pass).
        eval_tokens: held-out rows used for those evaluations.
        patience: evaluations without improvement before stopping.
        seed: parameter init and shuffling.
        precision: "auto" (bf16 autocast on CUDA devices that support it, else fp32), "fp32" or "bf16".
    """

    epochs: int = 8
    batch_tokens: int = 512
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_frac: float = 0.05
    min_lr_ratio: float = 0.05
    eval_every: int = 0
    eval_tokens: int = 8192
    patience: int = 6
    seed: int = 0
    precision: str = "auto"


@dataclass
class TrainResult:
    """What training did.

    Attributes:
        recall, weighted_recall: served layer -> on every held-out row, with the kept weights.
        best_step: served layer -> the step whose weights were kept.
        steps, train_rows: optimizer steps taken and rows seen per layer.
        stopped_early: patience ran out before the last epoch ended.
        seconds: wall time of the training loop.
        history: (step, loss, mean eval recall) at every evaluation.
    """

    recall: dict[int, float]
    weighted_recall: dict[int, float]
    best_step: dict[int, int]
    steps: int
    train_rows: int
    stopped_early: bool
    seconds: float
    history: list[tuple[int, float, float]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def topk_select(k: int) -> Select:
    """Plain top-k of the logits (softmax routers; tests)."""
    return lambda layer, logits: torch.topk(logits, k, dim=-1).indices


def kl_to_router(z_est: torch.Tensor, z_true: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(softmax(z_true) || softmax(z_est)), logits [B, E] (computed in fp32)."""
    return F.kl_div(F.log_softmax(z_est.float(), dim=-1), F.log_softmax(z_true.float(), dim=-1),
                    log_target=True, reduction="batchmean")


def recall_counts(pred_ids: torch.Tensor, true_ids: torch.Tensor, true_w: torch.Tensor) -> tuple[int, int, float, float]:
    """(hits, K*T, weighted hit, weighted total) of predicted ids [T, K] vs the true routing [T, K]."""
    hit = (true_ids.unsqueeze(-1) == pred_ids.unsqueeze(-2)).any(dim=-1)  # [T, K]
    w = true_w.double()
    return int(hit.sum()), hit.numel(), float((w * hit).sum()), float(w.sum())


def _autocast(device: torch.device, precision: str):
    import contextlib

    bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported())
    if not bf16:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


class _HeldOut:
    """Held-out rows, streamed shard by shard (the first ``limit`` rows kept in memory for evaluations)."""

    def __init__(self, folder: Path, names: list[str], layers: list[int], device: torch.device, limit: int) -> None:
        self.folder, self.names, self.layers, self.device = folder, names, layers, device
        self.head: dict[str, dict[int, torch.Tensor]] = {}
        rows = 0
        for name in names:
            part = load_shard(folder / name, layers)
            take = min(limit - rows, part["ids"][layers[0]].shape[0])
            for k, per_layer in part.items():
                for layer, t in per_layer.items():
                    self.head.setdefault(k, {}).setdefault(layer, []).append(t[:take])
            rows += take
            if rows >= limit:
                break
        self.head = {k: {layer: torch.cat(v).to(device) for layer, v in d.items()} for k, d in self.head.items()}

    def shards(self):
        for name in self.names:
            yield {k: {layer: t.to(self.device) for layer, t in d.items()}
                   for k, d in load_shard(self.folder / name, self.layers).items()}


@torch.no_grad()
def evaluate(bank: EstimatorBank, rows: dict[str, dict[int, torch.Tensor]], select: Select,
             precision: str = "fp32", chunk: int = 4096) -> dict[int, tuple[int, int, float, float]]:
    """Served layer -> (hits, total, weighted hit, weighted total) of the bank on ``rows``."""
    device = next(bank.parameters()).device
    out = {}
    for layer in bank.layers:
        q, ids, w = rows["state"][layer], rows["ids"][layer], rows["weights"][layer]
        acc = [0, 0, 0.0, 0.0]
        for i in range(0, q.shape[0], chunk):
            with _autocast(device, precision):
                z = bank(q[i : i + chunk].float(), layer)  # [t, E]
            got = recall_counts(select(layer, z.float()), ids[i : i + chunk], w[i : i + chunk])
            acc = [a + b for a, b in zip(acc, got)]
        out[layer] = tuple(acc)
    return out


def train_bank(bank: EstimatorBank, folder: Path, manifest: StatesManifest, cfg: TrainConfig, select: Select,
               progress: TrainProgress | None = None) -> TrainResult:
    """Train ``bank`` (already on its device) on the states in ``folder``; keep the best weights.

    Args:
        bank: estimators of ``manifest.layers``.
        folder: the states folder; ``manifest`` its manifest.
        cfg: the settings.
        select: the next layers' routing rule on logits (recall@K is measured through it).
        progress: called after every step.
    """
    t0 = time.perf_counter()
    folder = Path(folder)
    device = next(bank.parameters()).device
    layers = list(bank.layers)
    gen = torch.Generator().manual_seed(cfg.seed)
    train_names = list(manifest.shards["train"])
    shard_rows = [_rows(folder / n) for n in train_names]
    steps_per_epoch = sum(math.ceil(r / cfg.batch_tokens) for r in shard_rows)
    total = max(1, steps_per_epoch * cfg.epochs)
    eval_every = cfg.eval_every or max(1, min(steps_per_epoch, 200))
    warmup = max(1, int(total * cfg.warmup_frac))
    opt = torch.optim.AdamW(bank.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, warmup, total, cfg.min_lr_ratio))
    held = _HeldOut(folder, manifest.shards["heldout"], layers, device, cfg.eval_tokens)

    shared = bank.shape.shared
    best = {layer: -1.0 for layer in layers}
    best_state = {layer: bank.layer_state(layer) for layer in layers}
    best_step = {layer: 0 for layer in layers}
    history: list[tuple[int, float, float]] = []
    step, since_better, stopped, rows_seen = 0, 0, False, 0
    loss_ema = float("nan")

    def check() -> bool:
        """Evaluate; keep improved weights; True when patience ran out."""
        nonlocal since_better
        bank.eval()
        counts = evaluate(bank, held.head, select, cfg.precision)
        bank.train()
        rec = {layer: c[0] / max(c[1], 1) for layer, c in counts.items()}
        mean = sum(rec.values()) / len(rec)
        history.append((step, loss_ema, mean))
        improved = False
        if shared:
            if mean > best[layers[0]] + 1e-6:
                improved = True
                for layer in layers:
                    best[layer], best_step[layer] = mean, step
                best_state[layers[0]] = bank.layer_state(layers[0])
        else:
            for layer in layers:
                if rec[layer] > best[layer] + 1e-6:
                    improved = True
                    best[layer], best_step[layer] = rec[layer], step
                    best_state[layer] = bank.layer_state(layer)
        since_better = 0 if improved else since_better + 1
        if progress is not None:
            progress(step, total, loss_ema, mean)
        return since_better >= cfg.patience

    bank.train()
    for _epoch in range(cfg.epochs):
        for si in torch.randperm(len(train_names), generator=gen).tolist():
            part = load_shard(folder / train_names[si], layers, ("state", "logits"))
            n = part["logits"][layers[0]].shape[0]
            order = torch.randperm(n, generator=gen)
            for i in range(0, n, cfg.batch_tokens):
                idx = order[i : i + cfg.batch_tokens]
                with _autocast(device, cfg.precision):
                    loss = sum(kl_to_router(bank(part["state"][layer][idx].to(device).float(), layer),
                                            part["logits"][layer][idx].to(device)) for layer in layers) / len(layers)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                step += 1
                rows_seen += idx.numel()
                lv = float(loss.detach())
                loss_ema = lv if math.isnan(loss_ema) else 0.95 * loss_ema + 0.05 * lv
                if step % eval_every == 0 and check():
                    stopped = True
                    break
                if progress is not None:
                    progress(step, total, loss_ema, float("nan"))
            if stopped:
                break
        if stopped:
            break
    if not stopped and (not history or history[-1][0] != step):
        check()
    for layer in (layers[:1] if shared else layers):
        bank.load_layer_state(layer, best_state[layer])
    bank.eval()
    recall, weighted = _full_recall(bank, held, select, cfg.precision)
    return TrainResult(recall=recall, weighted_recall=weighted, best_step=best_step, steps=step, train_rows=rows_seen,
                       stopped_early=stopped and step < total, seconds=time.perf_counter() - t0, history=history)


def _full_recall(bank: EstimatorBank, held: _HeldOut, select: Select, precision: str):
    acc = {layer: [0, 0, 0.0, 0.0] for layer in bank.layers}
    for rows in held.shards():
        for layer, got in evaluate(bank, rows, select, precision).items():
            acc[layer] = [a + b for a, b in zip(acc[layer], got)]
    recall = {layer: a[0] / a[1] if a[1] else math.nan for layer, a in acc.items()}
    weighted = {layer: a[2] / a[3] if a[3] else math.nan for layer, a in acc.items()}
    return recall, weighted


def _lr_factor(step: int, warmup: int, total: int, floor: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def _rows(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        key = next(k for k in f.keys() if k.startswith("logits/"))
        return int(f.get_slice(key).get_shape()[0])
