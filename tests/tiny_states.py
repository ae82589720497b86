"""A one-shard estimator states folder for the file-check tests (test_integrity, test_json_checksum)."""

from __future__ import annotations

from pathlib import Path

import torch

from moespec.estimator.states import ShardWriter, StatesManifest


def one_shard_states(folder: Path) -> StatesManifest:
    """Make ``folder`` with one train shard of 8 rows (state/0 bf16 [8, 4], logits/0 [8, 3]); return its
    manifest (not written: the caller writes it as its test needs)."""
    folder.mkdir()
    writer = ShardWriter(folder, "train")
    writer.add({"state/0": torch.randn(8, 4).to(torch.bfloat16), "logits/0": torch.randn(8, 3)})
    writer.flush()
    return StatesManifest(model="m", config_hash="c", router_fingerprint="r", moe_layers=[0, 1], layers=[0],
                          targets=[1], input="router", hidden=4, experts=3, top_k=1, tokens=8,
                          shards={"train": writer.names, "heldout": []})
