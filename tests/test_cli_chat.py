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
    assert "TPOT" in r.output and "H2D" in r.output and "ms/tok · lru" in r.output  # footer ends with the policy


def test_footer_names_host_experts_unless_fetch(tiny_models):
    r = _chat(tiny_models["mixtral"], "-p", "hi", "--max-new-tokens", "4", "--predictor", "none",
              "--cache-experts", "4", "--on-miss", "host")
    assert r.exit_code == 0, r.output
    footer = next(line for line in r.output.splitlines() if line.startswith("TPOT"))
    # The tiny mixtral: top-2 x 3 MoE layers; `host` never fills the cache, so all 6 run on the host.
    assert footer.endswith("H2D 0.00 MB · stall 0.00 ms · host 6.00 · lru"), footer
    r = _chat(tiny_models["mixtral"], "-p", "hi", "--max-new-tokens", "4", "--predictor", "none",
              "--cache-experts", "4")
    assert " · host " not in r.output and "ms/tok · lru" in r.output  # --on-miss fetch: as before


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


# --- a conversation through the REPL (issue 14) -------------------------------------------------

def _greedy_json(folder, *args, input=None):
    r = _chat(folder, "--json", "--max-new-tokens", "6", *args, input=input)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_help_and_unknown_commands_never_reach_the_model(tiny_models):
    r = _chat(tiny_models["mixtral"], "--max-new-tokens", "2", input="/help\n/foo bar\n/exit\n")
    assert r.exit_code == 0, r.output
    for cmd in ("/help", "/reset", "/stats", "/exit"):
        assert cmd in r.output
    assert "unknown command /foo" in r.output
    assert "TPOT" not in r.output  # nothing was answered


def test_ctrl_c_or_ctrl_d_at_the_prompt_exits_cleanly(tiny_models, monkeypatch):
    import moespec.cli.chat_cmd as chat_cmd

    r = _chat(tiny_models["mixtral"], input="")  # Ctrl-D: end of input
    assert r.exit_code == 0, r.output

    def interrupted(reader):
        raise KeyboardInterrupt

    monkeypatch.setattr(chat_cmd, "_read_line", interrupted)
    r = _chat(tiny_models["mixtral"])
    assert r.exit_code == 0, r.output
    assert "Traceback" not in r.output


def test_ctrl_c_during_an_answer_returns_to_the_prompt(tiny_models, monkeypatch):
    from moespec.runtime.layer.runner import MoeLayerRunner

    real_run, calls = MoeLayerRunner.run, []

    def run(self, block, x):
        calls.append(1)
        if len(calls) == 3 * 3:  # 3 MoE layers: the interrupt hits the third forward (2nd decode step)
            raise KeyboardInterrupt
        return real_run(self, block, x)

    monkeypatch.setattr(MoeLayerRunner, "run", run)
    r = _chat(tiny_models["mixtral"], "--max-new-tokens", "4", "--link-gbps", "0.001", "--system", "Be brief.",
              input="hello\nagain\n/stats\n/exit\n")
    assert r.exit_code == 0, r.output
    assert "interrupted;" in r.output and "Traceback" not in r.output
    assert r.output.count("TPOT") == 1  # only the second question was answered in full
    assert "reused from the KV cache" in r.output


def test_json_needs_prompt_and_prompt_dash_reads_stdin(tiny_models):
    r = _chat(tiny_models["mixtral"], "--json")
    assert r.exit_code == 2 and "--prompt" in r.output and "Traceback" not in r.output
    a = _greedy_json(tiny_models["mixtral"], "--prompt", "-", input="What is 2+2?\n")
    b = _greedy_json(tiny_models["mixtral"], "--prompt", "What is 2+2?")
    assert a == {**b, "stats": a["stats"]} and a["stats"]["prompt_tokens"] == b["stats"]["prompt_tokens"]
    r = _chat(tiny_models["mixtral"], "--prompt", "-", input="  \n")
    assert r.exit_code == 2 and "empty" in r.output


def test_sampling_tiny_temperature_is_greedy_and_seed_repeats(tiny_models):
    folder = tiny_models["qwen3_moe"]
    greedy = _greedy_json(folder, "-p", "hi")["text"]
    assert _greedy_json(folder, "-p", "hi", "--temperature", "1e-40")["text"] == greedy
    assert _greedy_json(folder, "-p", "hi", "--temperature", "1", "--top-p", "1e-9")["text"] == greedy
    hot = ["-p", "hi", "--temperature", "1.5", "--top-p", "0.9", "--seed", "7"]
    assert _greedy_json(folder, *hot)["text"] == _greedy_json(folder, *hot)["text"]
    for bad, needle in (("nan", "--temperature nan"), ("inf", "--temperature inf"), ("-1", "--temperature -1")):
        r = _chat(folder, "-p", "hi", "--temperature", bad)
        assert r.exit_code == 2 and needle in r.output, r.output
    r = _chat(folder, "-p", "hi", "--top-p", "0")
    assert r.exit_code == 2 and "--top-p 0" in r.output


def _with_template(tmp_path, folder, template):
    from transformers import AutoTokenizer

    d = tmp_path / "m"
    shutil.copytree(folder, d)
    tok = AutoTokenizer.from_pretrained(d)
    tok.chat_template = template
    tok.save_pretrained(d)
    return d


def test_chat_template_errors_are_one_line(tmp_path, tiny_models):
    d = _with_template(tmp_path, tiny_models["mixtral"], "{{ raise_exception('roles must alternate') }}")
    r = _chat(d, "-p", "hi")
    assert r.exit_code == 2 and "chat template failed: roles must alternate" in r.output
    assert "Traceback" not in r.output
    r = _chat(d, input="hi\n/exit\n")  # the REPL reports it and goes on
    assert r.exit_code == 0 and "chat template failed" in r.output and "Traceback" not in r.output


def test_system_with_a_template_without_system_role(tmp_path, tiny_models):
    from tiny import CHAT_TEMPLATE

    no_system = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
    d = _with_template(tmp_path, tiny_models["mixtral"], no_system + CHAT_TEMPLATE)
    r = _chat(d, "-p", "hi", "--system", "Be brief.", "--max-new-tokens", "2")
    assert r.exit_code == 0, r.output
    assert "--system prefixes the first message" in r.output
