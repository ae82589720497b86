"""Router estimators without a model: the trainer, shards, the file, the hybrid choice."""

from __future__ import annotations

import math

import pytest
import torch

from moespec.predict.calibration_file import config_hash
from moespec.errors import CalibrationError
from moespec.estimator.states import ShardWriter, StatesManifest, load_shard
from moespec.predict.estimator_file import EstimatorFile, check_matches, load_estimator, save_estimator
from moespec.estimator.hybrid import HybridConfig, choose
from moespec.predict.estimator_net import EstimatorBank, EstimatorShape
from moespec.estimator.train import TrainConfig, topk_select, train_bank

H, E, K = 16, 8, 2


def _teacher(seed: int):
    """A known nonlinear routing function q [T, H] -> z [T, E] that no linear router reproduces."""
    g = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(H, 8, generator=g) / H**0.5, torch.randn(8, E, generator=g)
    return lambda q: 3 * (q @ w1).abs() @ w2  # [T, E]: even in q, so no linear map of q ranks it


def _write_states(folder, teachers: dict, rows: int, heldout: int, shard_bytes: int = 2**16):
    g = torch.Generator().manual_seed(0)
    manifest = StatesManifest(model="synthetic", config_hash="x", router_fingerprint="y", moe_layers=[0, 1, 2],
                              layers=sorted(teachers), targets=[t + 1 for t in sorted(teachers)], input="router",
                              hidden=H, experts=E, top_k=K)
    for split, n in (("train", rows), ("heldout", heldout)):
        writer = ShardWriter(folder, split, shard_bytes)
        for _ in range(0, n, 512):
            batch = {}
            for layer, fn in teachers.items():
                q = torch.randn(512, H, generator=g)  # [T, H]
                z = fn(q)  # [T, E]
                w, ids = torch.topk(torch.softmax(z, -1), K, dim=-1)
                batch.update({f"state/{layer}": q.to(torch.bfloat16), f"logits/{layer}": z, f"ids/{layer}": ids,
                              f"weights/{layer}": w / w.sum(-1, keepdim=True)})
            writer.add(batch)
        writer.flush()
        manifest.shards[split] = writer.names
    manifest.tokens, manifest.heldout_tokens = rows, heldout
    return manifest


def test_training_reaches_high_recall_on_a_known_nonlinear_routing(tmp_path):
    teacher = _teacher(1)
    manifest = _write_states(tmp_path, {0: teacher}, rows=16384, heldout=2048)
    assert len(manifest.shards["train"]) > 1  # streamed in several shards
    torch.manual_seed(0)
    bank = EstimatorBank(EstimatorShape(H, E, down=1, expand=4), [0])
    result = train_bank(bank, tmp_path, manifest, TrainConfig(epochs=10, batch_tokens=256, lr=1e-2), topk_select(K))
    assert result.recall[0] >= 0.9
    assert result.history and result.steps > 0 and result.train_rows >= result.steps
    # A linear map (what a router is) on the same state falls well short of the estimator.
    held = load_shard(tmp_path / manifest.shards["heldout"][0], [0])
    q, ids = held["state"][0].float(), held["ids"][0]
    train = load_shard(tmp_path / manifest.shards["train"][0], [0])
    w = torch.linalg.lstsq(train["state"][0].float(), train["logits"][0]).solution  # [H, E]
    linear_hit = (ids.unsqueeze(-1) == torch.topk(q @ w, K).indices.unsqueeze(-2)).any(-1).float().mean()
    assert float(linear_hit) < 0.5


def test_training_is_deterministic_with_a_seed(tmp_path):
    manifest = _write_states(tmp_path, {0: _teacher(2)}, rows=2048, heldout=512)
    recalls = []
    for _ in range(2):
        torch.manual_seed(0)
        bank = EstimatorBank(EstimatorShape(H, E, down=2, expand=2), [0])
        recalls.append(train_bank(bank, tmp_path, manifest, TrainConfig(epochs=1, batch_tokens=256), topk_select(K)).recall)
    assert recalls[0] == recalls[1]


def test_shards_hold_every_row_in_order(tmp_path):
    writer = ShardWriter(tmp_path, "train", shard_bytes=300)  # 160 bytes of states per add
    rows = [torch.randn(10, 8) for _ in range(5)]
    for r in rows:
        writer.add({"state/3": r.to(torch.bfloat16), "logits/3": r})
    writer.flush()
    assert len(writer.names) > 1 and writer.rows == 50
    got = torch.cat([load_shard(tmp_path / n, [3], ("logits",))["logits"][3] for n in writer.names])
    assert torch.equal(got, torch.cat(rows))


def test_shared_bank_is_one_network_told_apart_by_the_layer_embedding():
    per_layer = EstimatorBank(EstimatorShape(64, E, down=4, expand=2), [0, 2, 5])
    shared = EstimatorBank(EstimatorShape(64, E, down=4, expand=2, shared=True), [0, 2, 5])
    assert len(per_layer.nets) == 3 and len(shared.nets) == 1
    assert per_layer.num_parameters() == 3 * per_layer.num_parameters(0)
    assert shared.num_parameters() < per_layer.num_parameters()
    q = torch.randn(4, 64)
    assert shared(q, 0).shape == (4, E)
    with torch.no_grad():
        shared.nets[0].layer_emb.weight.normal_()
    assert not torch.allclose(shared(q, 0), shared(q, 5))


def _estimator_file(shared: bool = False) -> EstimatorFile:
    torch.manual_seed(0)
    bank = EstimatorBank(EstimatorShape(32, E, down=2, expand=2, shared=shared), [0, 1])
    metrics = {"recall/router": torch.tensor([0.3, 0.99, math.nan]), "recall/estimator": torch.tensor([0.95, 0.97, math.nan])}
    return EstimatorFile(bank=bank.eval(), moe_layers=[0, 1, 2], input="quasi", vectors=torch.randn(2, E, 32),
                         choice={0: "estimator", 1: "router"}, metrics=metrics,
                         meta={"model": "tiny", "config_hash": config_hash({"hidden_size": 32}),
                               "router_fingerprint": "abc", "tokens": 100})


@pytest.mark.parametrize("shared", [False, True])
def test_file_round_trips(tmp_path, shared):
    ef = _estimator_file(shared)
    path = save_estimator(tmp_path / "est.safetensors", ef)
    got = load_estimator(path)
    q = torch.randn(3, 32)
    with torch.no_grad():
        for layer in (0, 1):
            torch.testing.assert_close(got.bank(q, layer), ef.bank(q, layer))
    assert got.layers == [0, 1] and got.moe_layers == [0, 1, 2] and got.input == "quasi"
    assert got.choice == {0: "estimator", 1: "router"} and got.bank.shape == ef.bank.shape
    assert torch.equal(got.vectors, ef.vectors) and got.meta["tokens"] == 100
    assert got.metric("recall", "estimator", 0) == pytest.approx(0.95) and math.isnan(got.metric("recall", "quasi", 0))
    assert [p.name for p in tmp_path.iterdir()] == ["est.safetensors"]  # no temp file left behind


def test_a_file_for_another_model_is_refused(tmp_path):
    ef = _estimator_file()
    path = save_estimator(tmp_path / "est.safetensors", ef)
    loaded = load_estimator(path)
    check_matches(loaded, path, {"hidden_size": 32}, [0, 1, 2], "abc")  # its own model: fine
    with pytest.raises(CalibrationError, match="was made for tiny"):
        check_matches(loaded, path, {"hidden_size": 64}, [0, 1, 2], "abc")
    with pytest.raises(CalibrationError, match="covers MoE layers"):
        check_matches(loaded, path, {"hidden_size": 32}, [0, 1, 2, 3], "abc")
    with pytest.raises(CalibrationError, match="router weights differ"):
        check_matches(loaded, path, {"hidden_size": 32}, [0, 1, 2], "other")


def test_a_corrupt_file_is_refused(tmp_path):
    path = tmp_path / "est.safetensors"
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(CalibrationError, match="not a readable"):
        load_estimator(path)
    with pytest.raises(CalibrationError, match="does not exist"):
        load_estimator(tmp_path / "missing.safetensors")


def test_hybrid_needs_the_margin_and_a_paying_cost():
    cost = {"router": 0.01, "quasi": 0.02, "estimator": 0.11}
    free = HybridConfig(margin=0.02, link_gbps=None)
    assert choose({"router": 0.5, "quasi": 0.6, "estimator": 0.9}, cost, 8, 10**6, free).predictor == "estimator"
    assert choose({"router": 0.5, "quasi": 0.89, "estimator": 0.9}, cost, 8, 10**6, free).predictor == "quasi"
    assert choose({"router": 0.7, "quasi": 0.6}, cost, 8, 10**6, free).predictor == "router"  # not served
    # A gain of 0.3 saves 0.3 * 8 copies of 1 MB (0.04 ms each at 25 GB/s): 0.096 ms > 0.09 ms extra cost.
    fast = choose({"router": 0.5, "quasi": 0.6, "estimator": 0.9}, cost, 8, 10**6, HybridConfig(link_gbps=25.0))
    assert fast.predictor == "estimator" and fast.saved_ms == pytest.approx(0.3 * 8 * 0.04) and fast.extra_ms == pytest.approx(0.09)
    tiny = choose({"router": 0.5, "quasi": 0.6, "estimator": 0.9}, cost, 8, 10**4, HybridConfig(link_gbps=25.0))
    assert tiny.predictor == "quasi"  # 100x smaller experts: the copies saved no longer pay for the estimator
