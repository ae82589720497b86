"""Against transformers' own GGUF loader, where it loads a file right, and where it does not.

transformers 5.24 loads qwen3moe GGUFs by dequantising every tensor in host RAM: on a file whose
expert width is its default (768) it must give moespec's logits. On two shapes seen in
llama.cpp-converted files it goes wrong and moespec must not: a qwen3moe expert width other than
768 (it ignores expert_feed_forward_length) and a qwen2moe shared-expert gate, which it reads as
[1, 1, H] and refuses (qwen2moe GGUFs with a shared expert do not load there at all). Its gpt-oss
path does not load llama.cpp's GPT-OSS files either: it reads the rope.scaling.* values as arrays.
"""

from __future__ import annotations

import pytest
import torch
from tiny_gguf import write_gguf

from moespec.config import RuntimeConfig
from moespec.gguf.export import ExportTypes
from moespec.runtime.load import load_offloaded

IDS = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(3))


def _moespec_logits(path) -> torch.Tensor:
    from moespec.hub.resolve import resolve_model

    om = load_offloaded(resolve_model(str(path)), RuntimeConfig(dtype="float32", cache_experts=4))
    try:
        with torch.inference_mode():
            return om.model(IDS).logits
    finally:
        om.close()


def _transformers(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def test_equal_to_transformers_from_pretrained_gguf(tmp_path):
    """qwen3moe at transformers' default expert width: its loader and moespec agree with the reference."""
    path, ref = write_gguf(tmp_path, "qwen3_moe", ExportTypes("Q8_0"), hidden=32, inter=768)
    with torch.no_grad():
        theirs = _transformers(path)(IDS).logits
        want = ref(IDS).logits
    ours = _moespec_logits(path)
    assert (theirs - want).abs().max() < 1e-5  # their loader agrees with the reference on this file
    assert (ours - theirs).abs().max() < 1e-5


def test_qwen3moe_expert_width_comes_from_expert_feed_forward_length(tmp_path):
    from moespec.runtime.host.gguf_source import GgufSource
    from moespec.hub.resolve import resolve_model

    path, ref = write_gguf(tmp_path, "qwen3_moe", ExportTypes("Q8_0"), hidden=32, inter=64)
    assert GgufSource.open(resolve_model(str(path))).config().moe_intermediate_size == 64
    with pytest.raises(RuntimeError, match="mismatched"):  # transformers keeps 768
        _transformers(path)
    with torch.no_grad():
        assert (_moespec_logits(path) - ref(IDS).logits).abs().max() < 1e-5


@pytest.mark.parametrize("gate_3d", [True, False])
def test_qwen2moe_shared_expert_gate(tmp_path, gate_3d):
    """transformers 5.24 reads the gate as [1, 1, H] (written [1, 1, H] or [1, H]) and refuses it."""
    path, ref = write_gguf(tmp_path, "qwen2_moe", ExportTypes("Q8_0"), hidden=32, inter=1408, layers=2,
                           shared_expert_intermediate_size=5632, shexp_gate_3d=gate_3d)
    with pytest.raises(RuntimeError, match="mismatched"):
        _transformers(path)
    with torch.no_grad():
        assert (_moespec_logits(path) - ref(IDS).logits).abs().max() < 1e-5


def test_gpt_oss_does_not_load_in_transformers_and_runs_in_moespec(tmp_path):
    """A GPT-OSS GGUF as llama.cpp writes it (yarn rope scaling, MXFP4 experts, sinks): transformers
    5.24 fails on its metadata; should it ever load, it must agree with the reference."""
    path, ref = write_gguf(tmp_path, "gpt_oss", ExportTypes("MXFP4"), hidden=64, inter=64)
    with torch.no_grad():
        want = ref(IDS).logits
        try:
            theirs = _transformers(path)(IDS).logits
        except TypeError as exc:  # float() of rope.scaling.factor's array
            assert "0-dimensional" in str(exc)
        else:
            assert (theirs - want).abs().max() < 1e-5
    assert (_moespec_logits(path) - want).abs().max() < 1e-5
