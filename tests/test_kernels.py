"""CPU kernels (moespec.kernels): every fast path against its slow reference, with stated tolerances.

Tolerances (relative to the largest output): float32 activations 2e-6 (exact arithmetic, another
order of the float32 sum: measured <= 6e-7); bfloat16 rows and activations: equal after the one
rounding to bfloat16 in these cases, allowed one bf16 ulp (2**-8); int8 activations (w8a8/w4a8)
against their own reference (same integer codes) 2e-6, against the exact product < 2e-2.
"""

from __future__ import annotations

import pytest
import torch
from lowbit_weights import random_lowbit

from moespec.kernels import linear as L
from moespec.kernels import native
from moespec.kernels.lowbit import dequantize

pytestmark = pytest.mark.skipif(native.library() is None, reason=native.status().note or "")



def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


# shapes: a short last group (80 = 64 + 16), g > C (16), several groups, odd row counts
SHAPES = [(40, 80, 64), (33, 48, 32), (9, 16, 64), (17, 96, 256), (6, 2048, 128)]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows,cols,group", SHAPES)
@pytest.mark.parametrize("tokens", [1, 3, 5, 9, 16])  # 1: t1.c; 3: tokens.c; 5, 9, 16: tiles.c (8, 16 wide)
def test_lowbit_kernels_equal_dequantise_then_linear(bits, rows, cols, group, tokens):
    w = random_lowbit(bits, rows, cols, group)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(1))
    assert L.plan(x, w) == "fused"
    assert _rel(L.linear(x, w), L.linear_reference(x, w)) < 2e-6
    assert L.plan(x, w, act_int8=True) == "a8"
    a8 = L.linear(x, w, act_int8=True)
    assert _rel(a8, L.linear_reference(x, w, act_int8=True)) < 2e-6
    assert 1e-5 < _rel(a8, L.linear_reference(x, w)) < 2e-2  # really quantised, and close


@pytest.mark.parametrize("bits", [8, 4])
def test_native_dequantisation_is_bit_for_bit_the_reference(bits):
    for rows, cols, group in SHAPES:
        w = random_lowbit(bits, rows, cols, group, seed=rows)
        assert torch.equal(L._dense_rows(w, 0, rows, torch.float32), dequantize(w, torch.float32))
        assert torch.equal(L._dense_rows(w, 2, 5, torch.float32), dequantize(w, torch.float32)[2:5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cols", [(37, 80), (5, 13), (64, 576), (9, 1037)])
@pytest.mark.parametrize("tokens", [1, 4, 8])
def test_dense_kernels_equal_linear(dtype, rows, cols, tokens):
    gen = torch.Generator().manual_seed(2)
    w, x = torch.randn(rows, cols, generator=gen).to(dtype), torch.randn(tokens, cols, generator=gen).to(dtype)
    assert L.plan(x, w) == "fused"
    got, want = L.linear(x, w), L.linear_reference(x, w)
    assert got.dtype == want.dtype == dtype
    assert _rel(got, want) < (2e-6 if dtype == torch.float32 else 2**-8)


def test_prefill_chunks_and_other_devices_take_the_gemm_path():
    w = random_lowbit(4, 8, 64, 64)
    x = torch.randn(L.FUSED_MAX_TOKENS + 1, 64)
    assert L.plan(x, w) == "gemm" and L.plan(x, w, act_int8=True) == "gemm"
    assert torch.equal(L.linear(x, w), L.linear_reference(x, w))  # the same dequantised weights, F.linear
    assert L.plan(torch.randn(1, 64, dtype=torch.float16), w) == "gemm"
    dense, x1 = torch.randn(8, 64), torch.randn(1, 64)
    torch.set_num_threads(2)  # a compute thread with intra-op threads: float weights keep F.linear
    try:
        assert L.plan(x1, dense) == "gemm" and L.plan(x1, w) == "fused"
    finally:
        torch.set_num_threads(1)
    assert L.plan(x1, dense) == "fused"
    assert L.plan(torch.randn(L.FUSED_MAX_TOKENS_F32, 64), dense) == "fused"  # float32 rows: tiles to t = 16
    assert L.plan(torch.randn(L.FUSED_MAX_TOKENS_F32 + 1, 64), dense) == "gemm"  # then MKL
    assert L.plan(torch.randn(L.FUSED_MAX_TOKENS, 64).bfloat16(), dense.bfloat16()) == "fused"


def test_rows_split_over_calls_equal_one_call():
    """What the host pool's threads do: each computes a range of output rows into one y."""
    w = random_lowbit(4, 50, 96, 32)
    x = torch.randn(1, 96)
    p = L.prepare(x, w)
    y = L.new_output(p, 50)
    for r0, r1 in ((0, 17), (17, 18), (18, 50)):
        L.run_rows(p, w, y, r0, r1)
    assert torch.equal(L.finish(p, y), L.linear(x, w))


@pytest.mark.parametrize("bits", [8, 4, 0])  # 0: bfloat16 rows
@pytest.mark.parametrize("tokens", [5, 16, 20, 33])  # 20, 33: several tiles of 16 (the C entry point)
def test_token_tiles_equal_the_reference_with_row_splits(bits, tokens):
    """csrc/tiles.c straight from C (any t, not just <= FUSED_MAX_TOKENS), rows split over calls:
    within 2e-6 of dequantise-then-F.linear in float32 (same products, another order of the sum)."""
    rows, cols = 45, 80
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(3))
    y = torch.full((tokens, rows), float("nan"))
    lib = native.library()
    if bits:
        w = random_lowbit(bits, rows, cols, 32, seed=tokens)
        want = torch.nn.functional.linear(x, dequantize(w, torch.float32))
        kind = native.KIND_Q4 if bits == 4 else native.KIND_Q8
        args = (w.codes.data_ptr(), w.scales.data_ptr(), w.zeros.data_ptr(), None, cols, 32)
    else:
        w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(4)).bfloat16()
        want = torch.nn.functional.linear(x, w.float())
        kind = native.KIND_BF16
        args = (w.data_ptr(), None, None, None, cols, 0)
    for r0, r1 in ((0, 7), (7, 30), (30, 45)):
        assert lib.linear_f32act(kind, x.data_ptr(), tokens, cols, *args, y.data_ptr(), rows, r0, r1) == 0
    assert _rel(y, want) < 2e-6


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "int4", "w4a8"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_one_call_expert_equals_its_two_call_reference(fmt, tokens):
    """moespec.kernels.swiglu (gate_up, SiLU * up, down in one C call) against dequantise, F.linear,
    torch's SiLU: float32 within 2e-6 of the largest output, bfloat16 within 2 bf16 ulps (a stage
    rounded to bf16 on either side of a tie), w4a8 against its own int8-activation reference 2e-5."""
    from moespec.kernels.swiglu import swiglu_expert
    from moespec.models.layout import ExpertLayout
    from moespec.models.quant_layout import QuantLayout

    act, gen = torch.nn.functional.silu, torch.Generator().manual_seed(4)
    if fmt in ("float32", "bfloat16"):
        layout, dtype = ExpertLayout(96, 48), getattr(torch, fmt)
        row = (torch.randn(layout.numel, generator=gen) * 0.1).to(dtype)
    else:
        layout, dtype = QuantLayout(96, 48, bits=8 if fmt == "int8" else 4, act_int8=fmt == "w4a8"), torch.float32
        row = torch.randint(0, 256, (layout.numel,), dtype=torch.uint8, generator=gen)
        for name in ("gate_up_scales", "down_scales"):
            layout.views(row)[name].view(torch.float16).fill_(0.01)
    x = torch.randn(tokens, 96, generator=gen).to(dtype)
    got = swiglu_expert(x, row, layout, act)
    assert got is not None and got.dtype == dtype and got.shape == (tokens, 96)
    w1, w2 = layout.linear_weights(row)
    ref = lambda a, w: L.linear_reference(a, w, layout.act_int8)  # noqa: E731
    gate, up = ref(x, w1).chunk(2, dim=-1)
    want = ref(act(gate) * up, w2)
    tol = {"bfloat16": 2 * 2**-8, "w4a8": 2e-5}.get(fmt, 2e-6)
    assert _rel(got, want) < tol
    assert swiglu_expert(x, row, layout, torch.nn.functional.gelu) is None  # other activations: two calls


def test_a_cpu_without_the_features_runs_the_reference_with_a_one_line_note(tiny_models, monkeypatch):
    """No AVX2: no crash, the reference path, the loader's one-line note says so; the same logits."""
    from moespec.config import Predictor, RuntimeConfig
    from moespec.runtime.load import load_offloaded

    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(7))
    cfg = RuntimeConfig(cache_experts=5, predictor=Predictor.NONE, expert_dtype="int4")
    out = {}
    for flags in (None, {"sse4_2", "avx"}):
        if flags is not None:
            monkeypatch.setattr(native, "cpu_flags", lambda: flags)
        native.status.cache_clear()
        try:
            om = load_offloaded(tiny_models["qwen3_moe"], cfg)
            with torch.inference_mode():
                out[flags is None] = om.model(ids).logits
            notes = om.notes
            om.close()
        finally:
            native.status.cache_clear()
        if flags is None:
            assert notes == []
        else:
            assert notes == ["this CPU lacks AVX2/FMA/F16C: experts computed on the CPU use the reference path "
                             "(dequantise, then matmul)"]
    assert torch.allclose(out[True], out[False], atol=1e-5, rtol=0)
