"""Calibration on tiny random models: default vectors, frequencies, recall, the file, determinism."""

from __future__ import annotations

import pytest
import torch
from tiny import make_checkpoint, reference_model

from moespec.calibrate.collect import VARIANTS
from moespec.calibrate.data import ChunkPlan
from moespec.calibrate.run import CalibrateConfig, calibrate, collect_default_vectors
from moespec.config import Predictor, RuntimeConfig
from moespec.errors import CalibrationError, OutputError
from moespec.models.base import Routing
from moespec.predict.base import RouterPredictor
from moespec.predict.calibration_file import config_hash, load_calibration, save_calibration
from moespec.predict.recall import routing_hits
from moespec.runtime.chunks import measure_recall
from moespec.runtime.load import load_offloaded

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]


def _chunks(n: int, seq_len: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (seq_len,), generator=g).tolist() for _ in range(n)]


def _plan() -> ChunkPlan:
    return ChunkPlan(calib=_chunks(3, 24, seed=1), heldout=_chunks(2, 24, seed=2))


def _load(folder, **kw):
    return load_offloaded(folder, RuntimeConfig(predictor=Predictor.NONE, **kw))


def _calibrate(folder, **kw):
    om = _load(folder, **kw)
    try:
        return calibrate(om, _plan(), CalibrateConfig(tokens=72, seq_len=24), "random ids", "random ids").calibration
    finally:
        om.close()


def _slow_reference(folder, chunks):
    """Per (MoE layer, expert): sum of raw outputs, sum of gate * raw, count, gate mass; one token at a time."""
    ref = reference_model(folder)
    cfg = ref.config
    e_count = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    moe = [i for i, layer in enumerate(ref.model.layers) if hasattr(layer.mlp, "experts")]
    h = cfg.hidden_size
    raw_sum = torch.zeros(len(moe), e_count, h, dtype=torch.float64)
    w_sum = torch.zeros_like(raw_sum)
    count = torch.zeros(len(moe), e_count, dtype=torch.int64)
    mass = torch.zeros(len(moe), e_count, dtype=torch.float64)
    inputs: dict[int, torch.Tensor] = {}
    hooks = [ref.model.layers[i].mlp.register_forward_pre_hook(
        lambda mod, args, i=i: inputs.__setitem__(i, args[0].reshape(-1, h))) for i in moe]
    with torch.no_grad():
        for chunk in chunks:
            ref(torch.tensor([chunk]))
            for m, i in enumerate(moe):
                mlp = ref.model.layers[i].mlp
                x = inputs[i]  # [T, H] router input s_l
                _, weights, ids = mlp.gate(x)
                for t in range(x.shape[0]):
                    for k in range(ids.shape[1]):
                        e = int(ids[t, k])
                        gate, up = (mlp.experts.gate_up_proj[e] @ x[t]).chunk(2)
                        y = (mlp.experts.down_proj[e] @ (mlp.experts.act_fn(gate) * up)).double()  # [H]
                        g = float(weights[t, k])
                        raw_sum[m, e] += y
                        w_sum[m, e] += g * y
                        count[m, e] += 1
                        mass[m, e] += g
    for hk in hooks:
        hk.remove()
    return raw_sum, w_sum, count, mass


@pytest.mark.parametrize("family", FAMILIES)
def test_default_vectors_equal_a_slow_reference_loop(tiny_models, family):
    folder = tiny_models[family]
    chunks = _chunks(2, 16)
    om = _load(folder, cache_experts=2)  # the minimum: every chunk streams each layer through 2 slots
    try:
        dv = collect_default_vectors(om, chunks)
    finally:
        om.close()
    raw_sum, w_sum, count, mass = _slow_reference(folder, chunks)
    seen = count > 0
    want_mean = raw_sum / count.clamp(min=1).unsqueeze(-1)
    want_weighted = w_sum / mass.clamp(min=1e-30).unsqueeze(-1)
    torch.testing.assert_close(dv.vectors["mean"][seen].double(), want_mean[seen], atol=1e-5, rtol=0)
    torch.testing.assert_close(dv.vectors["gate_weighted"][seen].double(), want_weighted[seen], atol=1e-5, rtol=0)
    assert torch.equal(dv.frequencies, count)
    assert torch.equal(dv.unrouted, (~seen).sum(dim=1))
    for m in range(seen.shape[0]):  # an expert never routed to gets the mean over the layer's routed experts
        if (~seen[m]).any():
            torch.testing.assert_close(dv.vectors["mean"][m, ~seen[m]][0].double(), want_mean[m, seen[m]].mean(0),
                                       atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_frequencies_sum_to_tokens_times_k(tiny_models, family):
    calib = _calibrate(tiny_models[family])
    k = calib.meta["top_k"]
    assert calib.meta["tokens"] == 72
    assert calib.frequencies.sum(dim=1).tolist() == [72 * k] * len(calib.layers)


class _TrueInputPredictor(RouterPredictor):
    """Fed the true next-layer residual r_{l+1} recorded in an earlier pass: its state is s_{l+1} itself."""

    def __init__(self, adapter, refs, recorded):
        super().__init__(adapter, refs)
        self.recorded = recorded

    def signal(self, layer, residual, used):
        return self.recorded[self.target(layer).layer]


class _ResidualRecorder:
    def __init__(self):
        self.residual = {}

    def routing(self, layer, x, residual, routing):
        self.residual[layer] = residual.reshape(-1, residual.shape[-1]).clone()

    def expert_output(self, layer, expert, token_idx, raw_output):
        pass


@pytest.mark.parametrize("family", FAMILIES)
def test_recall_of_the_true_next_router_input_is_one(tiny_models, family):
    from moespec.runtime.chunks import run_chunks

    om = _load(tiny_models[family])
    try:
        chunk = _chunks(1, 20)
        rec = _ResidualRecorder()
        run_chunks(om, chunk, rec, "heldout")
        refs = om.layer_refs()
        metrics = measure_recall(om, chunk, {"true": _TrueInputPredictor(om.adapter, refs, rec.residual),
                                             "router": RouterPredictor(om.adapter, refs)})
    finally:
        om.close()
    for name in ("recall/true", "weighted_recall/true"):
        assert torch.isnan(metrics[name][0])
        assert metrics[name][1:].tolist() == [1.0] * (len(refs) - 1)
    torch.testing.assert_close(metrics["cosine/true"][1:], torch.ones(len(refs) - 1))
    assert (metrics["recall/router"][1:] <= 1.0).all() and (metrics["recall/router"][1:] >= 0.0).all()


def test_routing_hits_counts_the_true_gate_mass_covered():
    true = Routing(ids=torch.tensor([[0, 1], [2, 3]]), weights=torch.tensor([[0.75, 0.25], [0.5, 0.5]]))
    pred = Routing(ids=torch.tensor([[1, 5], [3, 2]]), weights=torch.ones(2, 2))
    assert routing_hits(pred, true) == (3, 4, 1.25, 2.0)


def test_calibration_file_round_trips(tiny_models, tmp_path):
    calib = _calibrate(tiny_models["qwen3_moe"])
    path = save_calibration(tmp_path / "c.safetensors", calib)
    back = load_calibration(path)
    assert back.layers == calib.layers and back.variant == calib.variant
    assert back.variant in VARIANTS
    assert set(back.default_vectors) == set(VARIANTS)
    got = back.tensors()
    assert set(got) == set(calib.tensors())
    for k, v in calib.tensors().items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, equal_nan=True, msg=k)
    assert back.meta["config_hash"] == config_hash(reference_model(tiny_models["qwen3_moe"]).config)
    assert back.meta["tokens"] == 72 and back.meta["seq_len"] == 24
    assert {"recall", "weighted_recall", "cosine"} == {k.split("/")[0] for k in back.metrics}
    assert {"router", "quasi", "quasi_mean", "quasi_gate_weighted"} == set(back.predictors())
    assert back.vectors.dtype == torch.float32 and back.vectors.shape == (3, 8, 32)


def test_same_data_seed_and_model_give_a_byte_identical_file(tiny_models, tmp_path):
    a = save_calibration(tmp_path / "a.safetensors", _calibrate(tiny_models["olmoe"], cache_experts=3))
    b = save_calibration(tmp_path / "b.safetensors", _calibrate(tiny_models["olmoe"]))
    assert a.read_bytes() == b.read_bytes()


def test_a_file_for_another_model_is_refused(tiny_models, tmp_path):
    path = save_calibration(tmp_path / "q3.safetensors", _calibrate(tiny_models["qwen3_moe"]))
    for other in ("olmoe", "mixtral"):  # other architectures: the config hash differs
        with pytest.raises(CalibrationError, match="config hash"):
            load_offloaded(tiny_models[other], RuntimeConfig(predictor=Predictor.QUASI, calibration_path=str(path)))
    twin = make_checkpoint(tmp_path / "twin", "qwen3_moe", seed=7)  # same config, other weights
    with pytest.raises(CalibrationError, match="router weights differ"):
        load_offloaded(twin, RuntimeConfig(predictor=Predictor.QUASI, calibration_path=str(path)))


@pytest.mark.parametrize("content", [b"", b"not a safetensors file at all"])
def test_a_corrupt_or_empty_file_is_a_calibration_error(tmp_path, content):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(CalibrationError, match="bad.safetensors"):
        load_calibration(path)


def test_an_interrupted_write_leaves_no_file(tiny_models, tmp_path, monkeypatch):
    import safetensors.torch

    calib = _calibrate(tiny_models["qwen3_moe"])

    def interrupted(tensors, filename, metadata=None):
        with open(filename, "wb") as fh:
            fh.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_calibration(tmp_path / "c.safetensors", calib)
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_output_is_an_output_error(tmp_path):
    from moespec.predict.calibration_file import ensure_writable

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OutputError, match="cannot write"):
        ensure_writable(blocker / "c.safetensors")
    with pytest.raises(OutputError, match="is a folder"):
        ensure_writable(tmp_path)


def test_config_hash_ignores_dtype_and_transformers_version():
    base = {"model_type": "qwen3_moe", "hidden_size": 32, "num_experts": 8, "num_experts_per_tok": 2}
    same = dict(base, dtype="bfloat16", transformers_version="9.9", _name_or_path="/x")
    assert config_hash(base) == config_hash(same)
    assert config_hash(base) != config_hash(dict(base, hidden_size=64))
