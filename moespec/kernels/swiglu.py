"""One SwiGLU expert in ONE native call: y = down(silu(gate(x)) * up(x)) straight from a packed row.

Shapes: t tokens, H hidden, I expert intermediate.

Why: a decode expert of the default model (H 576, I 80) is ~140 k weights, ~15-30 us of kernel
work; two Linear calls, a chunk, a SiLU and a product around them cost as much again in Python and
dispatch. :func:`swiglu_expert` runs the gate_up product, the SiLU-and-product and the down product
in C (csrc/expert.c ``expert_swiglu``, the GIL released for all of it), reading the weights where the
row keeps them (``ExpertLayout.native_parts``: the kernel kind and the byte offsets of each weight's
data, scales and zeros). The two-call path (``ExpertLayout.forward``) is its reference, and the
fallback wherever this does not apply (another activation, a GPU row, more than FUSED_MAX_TOKENS
tokens, no native kernels).

Precision: float32 as the reference, summed in another order; silu(v) = v / (1 + exp(-v)) with
libm's expf (torch: Sleef, both within ~1 ulp). bfloat16 models: the products run in float32 and
each stage is rounded to bfloat16 where torch rounds it (gate_up, silu(gate), silu(gate) * up, y).
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from moespec.kernels import native, spin
from moespec.kernels.linear import FUSED_MAX_TOKENS, FUSED_MAX_TOKENS_F32


def is_silu(act) -> bool:
    """True for torch's and transformers' SiLU (the activation the C code computes)."""
    return act is F.silu or type(act).__name__ in ("SiLU", "SiLUActivation")


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of gate_up [t, 2I] (gate first) by the same C code as :func:`swiglu_expert`
    (so a row-split expert equals a one-call one bit for bit), or None where it does not apply."""
    lib = native.library()
    if lib is None or gate_up.device.type != "cpu" or gate_up.dtype not in (torch.float32, torch.bfloat16):
        return None
    g = gate_up.float().contiguous()  # [t, 2I]
    t, i = g.shape[0], g.shape[1] // 2
    h = torch.empty(t, i)
    lib.silu_mul(g.data_ptr(), t, i, h.data_ptr(), int(gate_up.dtype == torch.bfloat16))
    return h.to(gate_up.dtype)


def _native_parts(x: torch.Tensor, rows: torch.Tensor, layout, act):
    """(library, (kind, offsets, group)) where the one-call kernel applies to tokens x [t, H] and the
    CPU rows ``rows`` ([P] or [S, P]) of ``layout``, else None (the same test for one expert and a batch)."""
    lib = native.library()
    if (lib is None or rows.device.type != "cpu" or x.device.type != "cpu" or x.shape[0] > FUSED_MAX_TOKENS
            or x.dtype not in (torch.float32, torch.bfloat16) or not is_silu(act) or not rows.is_contiguous()):
        return None
    parts = layout.native_parts(rows.dtype, x.dtype)
    if parts is None or (parts[2] == 0 and torch.get_num_threads() > 1):  # float rows: as linear.plan
        return None
    if rows.dtype == torch.float32 and x.shape[0] > FUSED_MAX_TOKENS_F32:  # as linear.plan: F.linear
        return None
    return lib, parts


def swiglu_expert(x: torch.Tensor, row: torch.Tensor, layout, act) -> torch.Tensor | None:
    """Raw output [t, H] of the SwiGLU expert in the CPU ``row`` for x [t, H], or None where the
    one-call kernel does not apply (the caller then takes the two-call path)."""
    found = _native_parts(x, row, layout, act)
    if found is None:
        return None
    lib, (kind, offsets, group) = found
    t = x.shape[0]
    x32 = x.float().contiguous()  # [t, H]
    y = torch.empty(t, layout.hidden)  # [t, H] float32
    rc = lib.expert_swiglu(kind, int(layout.act_int8), int(x.dtype == torch.bfloat16), x32.data_ptr(), t,
                           row.data_ptr(), *offsets, layout.hidden, layout.intermediate, group, y.data_ptr())
    if rc != 0:
        raise MemoryError("the CPU expert kernel could not allocate its scratch memory")
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def swiglu_experts(x: torch.Tensor, slots: torch.Tensor, rows: list[int], layout, act) -> torch.Tensor | None:
    """Raw outputs [n, t, H] of the n SwiGLU experts held in ``slots[rows[j]]`` for the same tokens
    x [t, H], in ONE native call (csrc/expert.c ``experts_swiglu``: one GIL release and one Python
    round trip for a whole layer, not one per expert), or None where the one-call kernel does not
    apply (then :func:`swiglu_expert` does not either; the caller takes the per-expert path).

    Equal bit for bit to ``swiglu_expert(x, slots[r], layout, act)`` for each r (the same C code per
    expert); tests/test_expert_rows.py compares them. Within a decode step of the thread plan the
    experts are shared, one per chunk, with the step's spinning workers (kernels/spin.py; csrc/spin.c
    ``spin_experts``), each still computed whole by one thread, so the values do not change.

    Args:
        x: [t, H] tokens on the CPU; slots: [S, P] packed rows (the expert cache's slots, CPU);
        rows: n slot indices; layout, act: as :func:`swiglu_expert`.
    """
    found = _native_parts(x, slots, layout, act)
    if found is None or slots.dim() != 2:
        return None
    lib, (kind, offsets, group) = found
    t, n = x.shape[0], len(rows)
    x32 = x.float().contiguous()  # [t, H]
    y = torch.empty(n, t, layout.hidden)  # [n, t, H] float32
    index = (ctypes.c_int64 * n)(*rows)
    stride = slots.stride(0) * slots.element_size()  # bytes from one slot to the next
    args = (kind, int(layout.act_int8), int(x.dtype == torch.bfloat16), x32.data_ptr(), t, slots.data_ptr(), stride,
            index, n, *offsets, layout.hidden, layout.intermediate, group, y.data_ptr())
    pool = spin.active()  # a decode step's spinning workers (runtime/threads.py): one expert per chunk
    rc = lib.spin_experts(pool._handle, *args) if pool is not None else lib.experts_swiglu(*args)
    if rc != 0:
        raise MemoryError("the CPU expert kernel could not allocate its scratch memory")
    return y if x.dtype == torch.float32 else y.to(x.dtype)
