"""`moespec chat` through Typer's CliRunner: one-shot, JSON, REPL with scripted input, bad input."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from moespec.cli.app import app

runner = CliRunner()


def _chat(*args, input=None):
    return runner.invoke(app, ["chat", *map(str, args)], input=input)


def test_one_shot_json(tiny_models):
    r = _chat(tiny_models["qwen3_moe"], "--prompt", "hello", "--json", "--max-new-tokens", "6",
              "--cache-experts", "4", "--device", "cpu")
    assert r.exit_code == 0, r.output
    obj = json.loads(r.stdout.strip().splitlines()[-1])
    assert isinstance(obj["text"], str)
    st = obj["stats"]
    assert st["new_tokens"] >= 1 and st["prompt_tokens"] > 0
    assert 0 <= st["recall"] <= 1 and st["h2d_mb_per_token"] >= 0 and st["tpot_ms"] > 0


def test_threads_option_sets_torch_threads(tiny_models):
    import torch

    before = torch.get_num_threads()
    try:
        r = _chat(tiny_models["mixtral"], "-p", "hi", "--max-new-tokens", "2", "--threads", "2")
        assert r.exit_code == 0, r.output
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_one_shot_prints_footer(tiny_models):
    r = _chat(tiny_models["mixtral"], "-p", "hi", "--max-new-tokens", "4", "--predictor", "none")
    assert r.exit_code == 0, r.output
    assert "tok/s" in r.output and "TPOT" in r.output and "H2D" in r.output


def test_repl_scripted_input(tiny_models):
    script = "hello\n/stats\n/reset\nagain\n/exit\n"
    r = _chat(tiny_models["qwen2_moe"], "--max-new-tokens", "3", "--cache-experts", "6", input=script)
    assert r.exit_code == 0, r.output
    assert "history cleared" in r.output
    assert "per layer" in r.output  # the /stats table
    assert r.output.count("TPOT") == 2


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--cache-experts", "3"], "minimum of 4 experts"),
        (["--gpu-memory", "1KiB"], "minimum of 4 experts"),
        (["--device", "cuda"], "no CUDA"),
        (["--predictor", "psychic"], "--predictor 'psychic'"),
        (["--execute", "maybe"], "--execute 'maybe'"),
        (["--prompt", "   "], "empty"),
        (["--threads", "0"], "--threads 0 must be at least 1"),
    ],
)
def test_bad_options_give_clear_errors(tiny_models, args, needle):
    import torch

    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    base = ["--prompt", "hi"] if "--prompt" not in args else []
    r = _chat(tiny_models["qwen3_moe"], *base, *args)
    assert r.exit_code == 2, r.output
    assert needle in r.output
    assert "Traceback" not in r.output


def test_prompt_longer_than_context(tiny_models):
    r = _chat(tiny_models["qwen3_moe"], "--prompt", "x" * 400)
    assert r.exit_code == 2
    assert "context is 256 tokens" in r.output


def test_missing_folder_or_unknown_hub_id(tmp_path, monkeypatch):
    r = _chat(tmp_path / "nope", "-p", "hi")
    assert r.exit_code == 2 and "does not exist" in r.output
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    r = _chat("nobody/no-such-moe", "-p", "hi")
    assert r.exit_code == 2 and "moespec download" in r.output, r.output


def test_folder_without_safetensors(tmp_path, tiny_models):
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(tiny_models["qwen3_moe"] / "config.json", d)
    (d / "pytorch_model.bin").write_bytes(b"x")
    r = _chat(d, "-p", "hi")
    assert r.exit_code == 2 and "no *.safetensors" in r.output and ".bin" in r.output


def test_corrupt_safetensors_names_the_file(tmp_path, tiny_models):
    d = tmp_path / "m"
    shutil.copytree(tiny_models["qwen3_moe"], d)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])  # truncated
    r = _chat(d, "-p", "hi")
    assert r.exit_code == 2 and "model.safetensors" in r.output and "truncated or corrupt" in r.output


def test_dense_model_is_refused_with_supported_list(tmp_path):
    from tiny import make_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=260, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(d)
    make_tokenizer(d)
    r = _chat(d, "-p", "hi")
    assert r.exit_code == 2 and "'llama'" in r.output and "qwen3_moe" in r.output


def test_help_is_fast_and_lists_commands():
    import subprocess
    import sys
    import time

    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "moespec", "--help"], capture_output=True, text=True, check=True)
    assert "chat" in out.stdout
    code = "import moespec.cli.app, sys; print('torch' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "False"  # torch is imported lazily
    assert time.perf_counter() - t0 < 30  # generous bound: the real check is the lazy import above
