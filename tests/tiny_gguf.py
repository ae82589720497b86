"""Tiny GGUF MoE files for the tests: a tiny random transformers model written as llama.cpp would.

moespec.gguf.export converts it (names through gguf's tables, experts as ffn_*_exps, Mixtral's q/k
permuted, GPT-OSS's gate/up split, ...); the reference is the same transformers model with every
weight replaced by gguf's numpy dequantisation of what the file holds.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tiny import make_config, make_tokenizer

from moespec.gguf.export import ExportTypes, export_gguf


def random_model(family: str, seed: int = 0, **cfg):
    """A tiny random transformers model of ``family`` (float32, eval), routers with a larger init."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(family, **cfg), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.5 if name.endswith(("gate.weight", "router.weight")) else 0.08)
            if "norm" in name:
                p.fill_(1.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    return model


def write_gguf(folder: Path, family: str, types: ExportTypes = ExportTypes(), seed: int = 0, name: str | None = None,
               shexp_gate_3d: bool = False, split_max_tensors: int = 0, **cfg):
    """(path of the GGUF, reference model) for ``family`` with tensors stored as ``types`` (a split set's
    path is its first part's)."""
    folder.mkdir(parents=True, exist_ok=True)
    model = random_model(family, seed, **cfg)
    tokenizer = make_tokenizer(folder / "tokenizer")
    path = folder / (name or f"tiny-{family}-{types.experts}.gguf")
    ref = export_gguf(model, path, types, tokenizer, seed=seed, shexp_gate_3d=shexp_gate_3d,
                      split_max_tensors=split_max_tensors)
    model.load_state_dict(ref, strict=False)  # non-persistent buffers (rotary) are not in the file
    parts = sorted(folder.glob(f"{path.stem}-*-of-*.gguf"))
    return (parts[0] if parts else path), model
