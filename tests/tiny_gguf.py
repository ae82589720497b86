"""Tiny GGUF MoE files for the tests: a tiny random transformers model written as llama.cpp would.

moespec.gguf.export converts it (names through gguf's tables, experts as ffn_*_exps, Mixtral's q/k
permuted, GPT-OSS's gate/up split, ...); the reference is the same transformers model with every
weight replaced by gguf's numpy dequantisation of what the file holds.
"""

from __future__ import annotations

from pathlib import Path

from tiny import make_tokenizer, random_model

from moespec.gguf.export import ExportTypes, export_gguf


def write_gguf(folder: Path, family: str, types: ExportTypes = ExportTypes(), seed: int = 0, name: str | None = None,
               shexp_gate_3d: bool = False, split_max_tensors: int = 0, **cfg):
    """(path of the GGUF, reference model) for ``family`` with tensors stored as ``types`` (a split set's
    path is its first part's)."""
    folder.mkdir(parents=True, exist_ok=True)
    model = random_model(family, seed, **cfg).eval()
    tokenizer = make_tokenizer(folder / "tokenizer")
    path = folder / (name or f"tiny-{family}-{types.experts}.gguf")
    ref = export_gguf(model, path, types, tokenizer, seed=seed, shexp_gate_3d=shexp_gate_3d,
                      split_max_tensors=split_max_tensors)
    model.load_state_dict(ref, strict=False)  # non-persistent buffers (rotary) are not in the file
    parts = sorted(folder.glob(f"{path.stem}-*-of-*.gguf"))
    return (parts[0] if parts else path), model
