"""Router estimators on a tiny model built so that the router predictor fails in one layer.

The drift model (qwen3_moe, 3 layers, 8 experts, top-2, H=32): layer 0's router is zero, so every token
runs experts 0 and 1, whose low-rank SwiGLU outputs are scaled up 100x and layer 1's attention is
zeroed. Then r_1 = r_0 + m_0(LN(r_0)) is dominated by a known nonlinear function of the state, the
routing of layer 1 depends on it, and the router predictor (which sees r_0 only) is poor. Layer 1's
MoE output and layer 2's attention are scaled down 100x, so r_2 ≈ r_1 and the router predictor is
near perfect there.
"""

from __future__ import annotations

import json

import pytest
import torch
from tiny import make_checkpoint, reference_model
from typer.testing import CliRunner

from moespec.calibrate.data import ChunkPlan
from moespec.config import ExecuteMode, Predictor, RuntimeConfig, SamplingConfig
from moespec.errors import CalibrationError, DataError
from moespec.estimator.collect import collect_states
from moespec.estimator.states import StatesManifest, load_shard
from moespec.artifacts import default_estimator_path
from moespec.predict.estimator_file import load_estimator, save_estimator
from moespec.estimator.hybrid import HybridConfig
from moespec.estimator.run import EstimatorConfig, auto_layers, fit, prepare_states
from moespec.estimator.train import TrainConfig
from moespec.predict.base import RouterPredictor
from moespec.predict.estimator import EstimatorPredictor
from moespec.predict.quasi import QuasiPredictor
from moespec.runtime.engine import Engine
from moespec.runtime.load import load_offloaded
from moespec.runtime.stats import StatsRecorder


def make_drift_model(folder):
    from transformers import AutoModelForCausalLM

    make_checkpoint(folder, "qwen3_moe", seed=5)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        layers = model.model.layers
        layers[0].mlp.gate.weight.zero_()  # every token: experts 0 and 1, weight 1/2 each
        gate_up = layers[0].mlp.experts.gate_up_proj  # [E, 2I, H], I = 16
        for e in range(gate_up.shape[0]):  # rank 4: each expert output depends on 4 + 4 features of the state
            gate_up[e, :16] = gate_up[e, :4].repeat(4, 1)
            gate_up[e, 16:] = gate_up[e, 16:20].repeat(4, 1)
        layers[0].mlp.experts.down_proj.mul_(100)
        layers[1].self_attn.o_proj.weight.zero_()
        layers[1].mlp.experts.down_proj.mul_(0.01)
        layers[2].self_attn.o_proj.weight.mul_(0.01)
    model.save_pretrained(folder)
    return folder


def _chunks(n: int, seq_len: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (seq_len,), generator=g).tolist() for _ in range(n)]


PLAN = ChunkPlan(calib=_chunks(94, 128, 1), heldout=_chunks(9, 128, 2))  # 12032 + 1152 tokens
CFG = EstimatorConfig(down=1, expand=4, train=TrainConfig(epochs=12, batch_tokens=256, lr=2e-2),
                      hybrid=HybridConfig(margin=0.02, link_gbps=None))


@pytest.fixture(scope="module")
def drift(tmp_path_factory):
    return make_drift_model(tmp_path_factory.mktemp("drift") / "model")


@pytest.fixture(scope="module")
def trained(drift, tmp_path_factory):
    states = tmp_path_factory.mktemp("states")
    om = load_offloaded(drift, RuntimeConfig(predictor=Predictor.NONE))
    try:
        manifest, reused = prepare_states(om, PLAN, [0, 1], "router", None, states, False, "random ids", 128)
        outcome = fit(om, states, manifest, CFG, None)
    finally:
        om.close()
    assert not reused
    return states, outcome


def test_the_estimator_learns_the_layer_where_the_router_predictor_fails(trained):
    _, outcome = trained
    router = outcome.manifest.baseline["recall/router"]  # per source layer 0, 1, 2
    assert router[0] < 0.5 and router[1] > 0.95
    assert outcome.result.recall[0] >= 0.9
    assert outcome.manifest.tokens == 94 * 128 and outcome.manifest.heldout_tokens == 9 * 128


def test_hybrid_picks_the_estimator_exactly_where_it_wins(trained):
    _, outcome = trained
    assert outcome.file.choice == {0: "estimator", 1: "router"}
    assert outcome.choices[0].gain > 0.4


def test_auto_serves_the_drifting_layer(drift):
    om = load_offloaded(drift, RuntimeConfig(predictor=Predictor.NONE))
    try:
        layers, best, source = auto_layers(om, None, PLAN.heldout[:3], CFG)
    finally:
        om.close()
    assert layers == [0] and best[0] < 0.5 < best[1] and "router recall" in source


@pytest.mark.parametrize("kind", [Predictor.HYBRID, Predictor.ESTIMATOR])
def test_the_runtime_uses_the_file_and_stays_exact(drift, trained, kind):
    _, outcome = trained
    save_estimator(default_estimator_path(drift), outcome.file)
    om = load_offloaded(drift, RuntimeConfig(predictor=kind, execute=ExecuteMode.EXACT, cache_experts=6), StatsRecorder())
    try:
        pred = om.policy.predictor
        assert isinstance(pred, EstimatorPredictor) and pred.name == kind.value
        assert pred.modes == ({0: "estimator", 1: "router"} if kind == Predictor.HYBRID else {0: "estimator", 1: "estimator", 2: "router"})
        prompt = list(range(40, 60))
        got = list(Engine(om).generate(prompt, SamplingConfig(max_new_tokens=12)))
        layer1 = [s.layers[1] for s in om.recorder.steps if s.kind == "decode"]
    finally:
        om.close()
    with torch.no_grad():
        want = reference_model(drift).generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    assert got == want[0, len(prompt):].tolist()  # exact mode: the predictor only decides what is prefetched
    assert sum(s.recall_hits for s in layer1) / sum(s.recall_total for s in layer1) >= 0.75


def test_a_file_for_another_model_is_refused_at_load(tiny_models, trained, tmp_path):
    _, outcome = trained
    other = tiny_models["qwen3_moe"]  # same architecture and config as the drift model, other weights
    path = save_estimator(tmp_path / "drift-estimators.safetensors", outcome.file)
    with pytest.raises(CalibrationError, match="router weights differ"):
        load_offloaded(other, RuntimeConfig(predictor=Predictor.HYBRID, estimator_path=str(path)))
    with pytest.raises(CalibrationError, match="does not exist"):
        load_offloaded(other, RuntimeConfig(predictor=Predictor.HYBRID, estimator_path=str(tmp_path / "none")))


def test_states_are_reused_without_running_the_model(drift, trained, monkeypatch):
    states, outcome = trained

    def no_forward(*args, **kwargs):
        raise AssertionError("reused states must not run the model")

    monkeypatch.setattr(Engine, "forward", no_forward)
    om = load_offloaded(drift, RuntimeConfig(predictor=Predictor.NONE))
    try:
        manifest, reused = prepare_states(om, PLAN, [0, 1], "router", None, states, True, "random ids", 128)
        assert reused and manifest.shards == outcome.manifest.shards
        with pytest.raises(DataError, match="drop --reuse-states"):
            prepare_states(om, PLAN, [1], "router", None, states, True, "random ids", 128)
    finally:
        om.close()


def test_cli_calibrate_then_train_estimator_then_chat(drift, tmp_path):
    from moespec.cli.app import app

    runner = CliRunner()
    words = ["state", "union", "budget", "the", "of", "and", "nation", "war", "peace", "tax", "law", "people"]
    g = torch.Generator().manual_seed(0)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(words[i] for i in torch.randint(0, len(words), (2500,), generator=g).tolist()))
    res = runner.invoke(app, ["calibrate", str(drift), "--data", str(text), "--tokens", "2048", "--seq-len", "128"])
    assert res.exit_code == 0, res.output
    states = tmp_path / "states"
    common = ["train-estimator", str(drift), "--data", str(text), "--tokens", "4096", "--seq-len", "128",
              "--epochs", "2", "--down", "1", "--states-dir", str(states)]
    res = runner.invoke(app, common + ["--keep-states"])
    assert res.exit_code == 0, res.output
    out = res.output.replace("\n", " ")
    assert "serving layers 0 (auto" in out and "estimator input: quasi" in out and "hybrid uses estimators at layers" in out
    ef = load_estimator(default_estimator_path(drift))
    assert ef.input == "quasi" and ef.layers == [0] and ef.vectors.shape == (1, 8, 32)
    assert (states / "manifest.json").is_file()

    res = runner.invoke(app, common + ["--reuse-states", "--shared"])
    assert res.exit_code == 0, res.output
    assert "reused states" in res.output.replace("\n", " ") and load_estimator(default_estimator_path(drift)).bank.shape.shared

    res = runner.invoke(app, ["chat", str(drift), "--predictor", "hybrid", "--prompt", "hi", "--max-new-tokens", "3"])
    assert res.exit_code == 0, res.output

    res = runner.invoke(app, common + ["--layers", "2"])
    assert res.exit_code == 2 and "cannot be served" in res.output


def test_truncated_collection_writes_the_same_states_as_the_full_one(tmp_path):
    """The fast path (each training forward ends at the last target's router) against the slow reference
    (every layer runs): same rows, bit for bit, and the layer after the last target really is skipped."""
    model = make_checkpoint(tmp_path / "m", "qwen2_moe", seed=3, layers=4)  # shared expert, as the default model
    plan = ChunkPlan(calib=_chunks(5, 64, 3), heldout=_chunks(2, 64, 4))
    om = load_offloaded(model, RuntimeConfig(predictor=Predictor.NONE))
    ran: list[int] = []
    run = om.runner.run

    def counting(block, x):
        ran.append(block.layer)
        return run(block, x)

    om.runner.run = counting  # the offloaded blocks call runner.run: count MoE layers per forward
    try:
        refs = om.layer_refs()
        g = torch.Generator().manual_seed(0)
        vectors = torch.randn(4, 8, 32, generator=g)  # [L, E, H] default vectors, so quasi signals are exercised
        predictors = {"router": RouterPredictor(om.adapter, refs),
                      "quasi": QuasiPredictor(om.adapter, refs, {r.layer: vectors[r.layer] for r in refs})}
        got = {}
        for truncate in (True, False):
            manifest = StatesManifest(model="tiny", config_hash="x", router_fingerprint="y", moe_layers=[0, 1, 2, 3],
                                      layers=[0, 1], targets=[1, 2], input="quasi", hidden=32, experts=8, top_k=2)
            folder = tmp_path / f"states-{truncate}"
            ran.clear()
            got[truncate] = (collect_states(om, plan, manifest, predictors, folder, vectors[:2], truncate=truncate),
                             folder, ran.count(3))
    finally:
        om.close()
    (fast, fast_dir, fast_last), (slow, slow_dir, slow_last) = got[True], got[False]
    assert fast_last == len(plan.heldout) and slow_last == len(plan.calib) + len(plan.heldout)
    assert fast.tokens == slow.tokens == 5 * 64 and fast.heldout_tokens == slow.heldout_tokens == 2 * 64
    assert fast.shards == slow.shards and fast.baseline == slow.baseline
    for name in fast.shards["train"] + fast.shards["heldout"]:
        a, b = load_shard(fast_dir / name, [0, 1]), load_shard(slow_dir / name, [0, 1])
        for key in ("state", "logits", "ids", "weights"):
            for layer in (0, 1):
                torch.testing.assert_close(a[key][layer], b[key][layer], rtol=0, atol=0)
        assert a["state"][0].dtype == torch.bfloat16 and a["logits"][1].shape == (len(a["ids"][1]), 8)


def test_chat_and_profile_use_the_estimator_file_given_with_the_flag(drift, trained, tmp_path, monkeypatch):
    from moespec.cli.app import app

    _, outcome = trained
    monkeypatch.setenv("MOESPEC_HOME", str(tmp_path / "home"))
    default = default_estimator_path(drift)  # a corrupt file where chat looks by default...
    default.parent.mkdir(parents=True)
    default.write_bytes(b"not an estimator file")
    mine = save_estimator(tmp_path / "mine.safetensors", outcome.file)  # ...and a good one elsewhere
    runner = CliRunner()
    chat = ["chat", str(drift), "--predictor", "hybrid", "--prompt", "hi", "--max-new-tokens", "3"]

    res = runner.invoke(app, chat)
    assert res.exit_code == 2 and "not a readable moespec estimator file" in res.output
    res = runner.invoke(app, chat + ["--estimator", str(mine)])  # the flag overrides the default file
    assert res.exit_code == 0, res.output

    out = tmp_path / "report.json"
    res = runner.invoke(app, ["profile", str(drift), "--device", "cpu", "--threads", "1",
                              "--strategies", "router,hybrid", "--estimator", str(mine), "--prompt-len", "8",
                              "--gen", "3", "--repeats", "1", "--warmup", "0", "--out", str(out)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert report["options"]["estimator"] == str(mine) and report["options"]["strategies"] == ["router", "hybrid"]


@pytest.mark.parametrize("case", ["missing", "other model", "unused"])
def test_a_bad_estimator_flag_names_the_path_and_the_flag(drift, trained, tiny_models, tmp_path, case):
    from moespec.cli.app import app

    _, outcome = trained
    path = tmp_path / "est.safetensors"
    model, predictor, needle = drift, "hybrid", "does not exist"
    if case == "other model":  # same architecture and config as the drift model, other router weights
        save_estimator(path, outcome.file)
        model, needle = tiny_models["qwen3_moe"], "router weights differ"
    elif case == "unused":
        save_estimator(path, outcome.file)
        predictor, needle = "router", "read only by the estimator and hybrid predictors"
    runner = CliRunner()
    res = runner.invoke(app, ["chat", str(model), "--predictor", predictor, "--estimator", str(path), "--prompt", "hi",
                              "--max-new-tokens", "2"])
    assert res.exit_code == 2, res.output
    assert needle in res.output and str(path) in res.output and "--estimator" in res.output
    assert "Traceback" not in res.output
    if case == "unused":
        res = runner.invoke(app, ["profile", str(model), "--strategies", "none,router", "--estimator", str(path)])
        assert res.exit_code == 2 and "--estimator" in res.output, res.output
