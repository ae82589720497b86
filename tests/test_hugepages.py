"""Weight buffers on 2 MB pages (runtime/host/hugepages.py): aligned, the advice taken where THP is
in ``madvise`` mode, the same values; the dense path's weights moved there keep a tied embedding
shared and decode as the reference does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny import GREEDY_PROMPT, engine_steps, make_checkpoint

import moespec.runtime.dense as dense
from moespec.config import Predictor, RuntimeConfig
from moespec.kernels import native
from moespec.runtime.host import hugepages
from moespec.runtime.load import load_offloaded

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_empty_is_aligned_writable_and_copy_keeps_values(dtype):
    src = torch.randn(1500, 1000).to(dtype)  # >= 2 MB in every dtype but uint8 (1.5 MB: torch.empty)
    out = hugepages.copy(src)
    assert out.shape == src.shape and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, src)
    if src.numel() * src.element_size() >= hugepages.MIN_BYTES:
        assert out.data_ptr() % hugepages.HUGE_BYTES == 0


@pytest.mark.skipif(_thp_mode() != "madvise", reason="THP is not in madvise mode here")
def test_the_advice_gives_huge_pages():
    before = hugepages.huge_bytes()
    buf = hugepages.empty(((8 << 20) // 4,), torch.float32)  # 8 MB
    buf.fill_(1.0)
    assert hugepages.huge_bytes() - before >= 4 << 20  # at least two of its four 2 MB pages
    del buf


def test_disabled_or_small_take_torch_empty(monkeypatch):
    assert hugepages.empty((16,), torch.float32).shape == (16,)
    monkeypatch.setenv("MOESPEC_HUGE_PAGES", "0")
    assert not hugepages.enabled()
    w = torch.randn(1024, 1024)
    assert dense.on_huge_pages(w) is w


@pytest.mark.skipif(native.library() is None, reason="no native CPU kernels here")
def test_dense_weights_move_to_huge_pages_and_decode_as_the_reference(tmp_path, monkeypatch):
    monkeypatch.setattr(dense, "MIN_NATIVE_BYTES", 0)
    monkeypatch.setattr(hugepages, "MIN_BYTES", 0)  # tiny weights: move every one
    folder = make_checkpoint(tmp_path / "tied", "qwen3_moe", tie_word_embeddings=True)
    om = load_offloaded(folder, RuntimeConfig(predictor=Predictor.NONE))
    try:
        emb = om.model.get_input_embeddings().weight
        assert om.model.lm_head.weight.data_ptr() == emb.data_ptr()  # still one shared table
        assert emb.data_ptr() % hugepages.HUGE_BYTES == 0
        own = [m for n, m in om.model.named_modules() if n.endswith(("o_proj", "q_proj"))]  # q: the fused start
        assert own and all(om.dense.weights[m].data_ptr() % hugepages.HUGE_BYTES == 0 for m in own)
        fast, _ = engine_steps(om, GREEDY_PROMPT, 3)
        om.dense.reference = True
        ref, _ = engine_steps(om, GREEDY_PROMPT, 3)
    finally:
        om.close()
    torch.testing.assert_close(fast, ref, rtol=0, atol=1e-5)


def test_a_cpu_store_large_enough_lives_on_huge_page_memory_and_keeps_its_rows():
    from moespec.models.layout import ExpertLayout
    from moespec.runtime.host.store import ExpertStore

    layout = ExpertLayout(hidden=256, intermediate=256)  # 768 KiB a float32 expert, 4.5 MiB a store
    store = ExpertStore([0, 1], 3, layout, torch.float32)
    assert store.buffer.data_ptr() % hugepages.HUGE_BYTES == 0
    assert store.buffer.shape == (2, 3, layout.numel)
    store.expert(1, 2).fill_(2.5)
    assert float(store.buffer.sum()) == 2.5 * layout.numel


@pytest.mark.parametrize("huge", ["1", "0"])
def test_fused_weight_equals_the_plain_concatenation(monkeypatch, huge):
    monkeypatch.setenv("MOESPEC_HUGE_PAGES", huge)
    parts = [torch.randn(1024, 512), torch.randn(256, 512), torch.randn(256, 512)]  # 3 MB together
    fused = dense._fused_weight(parts, None)
    assert torch.equal(fused, torch.cat(parts)) and fused.is_contiguous()
    assert (fused.data_ptr() % hugepages.HUGE_BYTES == 0) == (huge == "1")
