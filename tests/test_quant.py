"""Group-wise int8/int4 quantisation: the arithmetic, the packed row, sizes and bad settings."""

from __future__ import annotations


import pytest
import torch

from moespec.errors import OptionError
from moespec.hub.sizes import model_sizes
from moespec.kernels.lowbit import pack_codes, unpack_codes, unpack_codes_reference
from moespec.models.quant import QuantSpec, dequantize, dequantize_reference, quantize
from moespec.models.quant_layout import QuantLayout


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("cols,group", [(48, 32), (80, 64), (64, 64), (16, 64)])
def test_fast_dequantize_is_bit_for_bit_torchao(bits, cols, group):
    """Groups along each row (a short last group where g does not divide C): fast == torchao."""
    w = torch.randn(40, cols, generator=torch.Generator().manual_seed(0)) * 0.05
    spec = QuantSpec(bits, group)
    q = quantize(w, spec)
    fast = dequantize(q, spec, 40, cols, torch.float32)
    assert torch.equal(fast, dequantize_reference(q, spec, 40, cols, torch.float32))
    # rounding costs half a step of the group's scale; the rounded zero point can shift the grid by
    # another half step at the ends of the range
    n = -(-cols // group)
    step = q.scales.float().view(40, n).repeat_interleave(group, dim=1)[:, :cols]
    err = (fast - w).abs() / step
    assert float(err.max()) <= 1.0 and float(err.mean()) <= 0.3
    assert q.codes.numel() == 40 * cols * bits // 8 and q.scales.numel() == q.zeros.numel() == 40 * n
    assert q.scales.dtype == torch.float16 and q.zeros.dtype == torch.uint8


def test_int4_codes_pack_in_blocks_of_32_and_16():
    """Byte i of a 32-column block holds codes i (low) and i + 16; of a last 16-column block, i and i + 8."""
    codes = torch.arange(48, dtype=torch.uint8).remainder(16).view(1, 48)  # one row: 32 + 16 columns
    packed = pack_codes(codes, 4)
    assert packed[:16].tolist() == [(c % 16) | ((c + 16) % 16) << 4 for c in range(16)]
    assert packed[16:].tolist() == [(c % 16) | ((c + 8) % 16) << 4 for c in range(32, 40)]
    assert torch.equal(unpack_codes(packed, 4, 1, 48), codes)
    assert torch.equal(unpack_codes_reference(packed, 4, 1, 48), codes)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows,cols", [(3, 96), (5, 80), (2, 16)])
def test_unpack_equals_the_reference_code_by_code(bits, rows, cols):
    codes = torch.randint(0, 2**bits, (rows, cols), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    packed = pack_codes(codes, bits)
    assert packed.numel() == rows * cols * bits // 8
    assert torch.equal(unpack_codes(packed, bits, rows, cols), codes)
    assert torch.equal(unpack_codes_reference(packed, bits, rows, cols), codes)


def test_groups_follow_the_rows_with_a_short_last_group():
    """[3, 80] with g = 64: per row a group of 64 columns and one of 16 (never across rows)."""
    w = torch.arange(240, dtype=torch.float32).view(3, 80)
    q = quantize(w, QuantSpec(8, 64))
    # range [0, max] of each group (zero is always representable)
    want = torch.tensor([[63.0, 79.0], [143.0, 159.0], [223.0, 239.0]]).view(-1) / 255
    assert torch.allclose(q.scales.float(), want, rtol=1e-3)
    back = dequantize(q, QuantSpec(8, 64), 3, 80, torch.float32)
    assert torch.allclose(back, w, atol=0.5)


@pytest.mark.parametrize("bits", [8, 4])
def test_row_holds_codes_scales_and_zeros_of_one_expert(bits):
    h, i, g = 96, 48, 64
    layout = QuantLayout(hidden=h, intermediate=i, bits=bits, group_size=g)
    groups = 2 * i * 2 + h * 1  # gate_up rows: 2 groups (64 + 32 columns); down rows: 1 group of 48
    used = 3 * h * i * bits // 8 + groups * 3  # codes + (fp16 scale, uint8 zero) per group
    assert layout.numel == used + (-used) % 16 and layout.numel % 16 == 0
    gen = torch.Generator().manual_seed(1)
    gate, up, down = (torch.randn(*s, generator=gen) for s in ((i, h), (i, h), (h, i)))
    row = torch.zeros(layout.numel, dtype=torch.uint8)
    convert = layout.converter()
    from moespec.models.layout import ExpertKey

    for part, w in (("gate", gate), ("up", up), ("down", down)):
        for key, t, _ in convert(ExpertKey(0, 0, part), w, part):
            layout.disk_view(row, key.part).copy_(t)
    got = layout.weights(row, torch.float32)
    spec = layout.spec
    fq = {n: dequantize(quantize(w, spec), spec, *w.shape, torch.float32)
          for n, w in (("gate", gate), ("up", up), ("down", down))}
    assert torch.equal(got["gate_up"], torch.cat([fq["gate"], fq["up"]]))
    assert torch.equal(got["down"], fq["down"])
    slow = layout.weights_reference(row, torch.float32)  # torchao per projection, codes unpacked one by one
    assert all(torch.equal(got[k], slow[k]) for k in ("gate_up", "down"))
    x = torch.randn(3, h, generator=gen)
    want = torch.nn.functional.linear(torch.nn.functional.silu(x @ fq["gate"].T) * (x @ fq["up"].T), fq["down"])
    got = layout.forward(x, row, torch.nn.functional.silu)  # the CPU kernels: float32, another order of the sum
    assert torch.allclose(got, want, rtol=0, atol=1e-6 * float(want.abs().max()))


def test_fused_gate_up_checkpoint_lands_where_per_expert_parts_do():
    from moespec.models.layout import ExpertKey

    layout = QuantLayout(hidden=32, intermediate=16, bits=8, group_size=32)
    fused = torch.randn(2, 32, 32, generator=torch.Generator().manual_seed(2))  # [E, 2I, H]
    rows = torch.zeros(2, 2, layout.numel, dtype=torch.uint8)
    convert = layout.converter()
    for key, t, _ in convert(ExpertKey(0, None, "gate_up"), fused, "fused"):
        layout.disk_view(rows[0, key.expert], key.part).copy_(t)
    for e in range(2):
        for part, w in (("gate", fused[e, :16]), ("up", fused[e, 16:])):
            for key, t, _ in convert(ExpertKey(0, e, part), w, part):
                layout.disk_view(rows[1, e], key.part).copy_(t)
    assert torch.equal(rows[0, :, :-16], rows[1, :, :-16])  # everything but the never-written down part


@pytest.mark.parametrize("group_size", [24, 7, 16, 512])
def test_bad_group_size_is_one_line_naming_the_sizes_the_kernels_take(group_size):
    with pytest.raises(OptionError) as info:
        QuantLayout(hidden=32, intermediate=16, bits=4, group_size=group_size)
    assert info.value.message == (f"--group-size {group_size} is not supported: the low-bit kernels take "
                                  "32, 64, 128 or 256")
    assert info.value.hint == "use --group-size 64"


def test_input_sizes_not_multiples_of_16_are_refused():
    with pytest.raises(OptionError, match="multiples of 16: the expert intermediate size I is 40"):
        QuantLayout(hidden=32, intermediate=40, bits=4)


def test_sizes_group_list_is_the_kernels():
    from moespec.hub.sizes import QUANT_GROUPS
    from moespec.kernels.lowbit import SUPPORTED_GROUPS

    assert QUANT_GROUPS == SUPPORTED_GROUPS


@pytest.mark.parametrize("dtype,bits,ceiling", [("int8", 8, 0.27), ("int4", 4, 0.15)])
def test_sizes_count_quantised_experts(dtype, bits, ceiling):
    cfg = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
           "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "num_experts": 128,
           "moe_intermediate_size": 768, "num_experts_per_tok": 8, "dtype": "bfloat16",
           "intermediate_size": 6144}
    s, f32 = model_sizes(cfg, dtype), model_sizes({**cfg, "dtype": "float32"})
    layout = QuantLayout(hidden=2048, intermediate=768, bits=bits, group_size=64)
    assert s.expert_bytes == layout.numel  # what the runtime stores and moves
    assert s.expert_bytes <= ceiling * f32.expert_bytes
    assert s.zero_cache_h2d_bytes_per_token == 48 * 8 * layout.numel
    assert s.expert_format == dtype and s.group_size == 64
    assert model_sizes(cfg, dtype, 128).expert_bytes < s.expert_bytes
    odd = {**cfg, "hidden_size": 576, "moe_intermediate_size": 80}  # down rows: a group of 64 and one of 16
    assert model_sizes(odd, dtype).expert_bytes == QuantLayout(hidden=576, intermediate=80, bits=bits).numel


def test_sizes_refuse_int4_for_gpt_oss():
    cfg = {"model_type": "gpt_oss", "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100,
           "num_local_experts": 4, "num_experts_per_tok": 2}
    with pytest.raises(OptionError, match="not supported for gpt_oss"):
        model_sizes(cfg, "int4")


def test_default_group_size_bytes_meet_the_issue_ratios():
    """Default model shape (H=576, I=80): int8 <= 0.27x and int4 <= 0.15x the float32 bytes."""
    f32 = 3 * 576 * 80 * 4
    assert QuantLayout(hidden=576, intermediate=80, bits=8).numel <= 0.27 * f32
    assert QuantLayout(hidden=576, intermediate=80, bits=4).numel <= 0.15 * f32


@pytest.mark.cuda
@pytest.mark.parametrize("bits", [8, 4])
def test_row_dequantised_on_the_device_equals_the_host(bits):
    """A row copied to the device computes there; a host row computes on the host for device tokens."""
    layout = QuantLayout(hidden=64, intermediate=32, bits=bits, group_size=64)
    gen = torch.Generator().manual_seed(5)
    row = torch.randint(0, 256, (layout.numel,), dtype=torch.uint8, generator=gen)
    row[:layout.part_shapes()["gate_up_scales"][0] + layout.part_shapes()["down_scales"][0]] = 0
    for name in ("gate_up_scales", "down_scales"):  # finite scales
        layout.views(row)[name].view(torch.float16).fill_(0.01)
    x = torch.randn(3, 64, generator=gen)
    act = torch.nn.functional.silu
    host = layout.forward(x, row, act)
    dev = layout.forward(x.cuda(), row.cuda(), act)
    assert torch.allclose(dev.cpu(), host, atol=1e-5)
    mixed = layout.forward(x.cuda(), row, act)  # host row, device tokens: computed on the host
    assert mixed.device.type == "cuda" and torch.equal(mixed.cpu(), host)
