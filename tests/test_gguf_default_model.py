"""(slow) The embedded default model round-trips through GGUF: exported with Q8_0 experts (F16
where rows are not whole blocks), loaded back, it answers the README question."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


def test_default_model_exported_to_gguf_answers_the_capital_of_france(default_model, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moespec.chat.open_model import open_model
    from moespec.chat.session import ChatSession
    from moespec.config import Predictor, RuntimeConfig, SamplingConfig
    from moespec.gguf.export import ExportTypes, export_gguf

    monkeypatch.setenv("MOESPEC_HOME", str(tmp_path / "home"))  # the prepared GGUF folder goes here, not beside the model
    model = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32).eval()
    path = tmp_path / "smollm2-135m-moe-Q8_0.gguf"
    export_gguf(model, path, ExportTypes("Q8_0", dense="Q8_0", fallback="F16"), AutoTokenizer.from_pretrained(default_model),
                pre="smollm")
    opened = open_model(str(path), RuntimeConfig(device="cpu", cache_experts=120, predictor=Predictor.ROUTER))
    try:
        session = ChatSession(opened.engine, opened.tokenizer, SamplingConfig(max_new_tokens=24))
        answer = "".join(session.send("What is the capital of France?"))
    finally:
        opened.close()
    assert "Paris" in answer
