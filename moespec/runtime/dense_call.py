"""Fused dense units of a decode step: q/k/v in one native call, gate/up + SiLU-and-product in two.

Shapes: T tokens, C input features, Rq/Rk/Rv the q/k/v rows, I intermediate, H hidden.

A decode step of the default model makes ~10 dense products per layer, each a Python forward, a
ctypes call and a few tensor allocations around ~20-80 us of kernel work. Two groups always read
the same input and can be one product over their rows concatenated:
  - an attention's q_proj, k_proj, v_proj (same x): :class:`FusedQKV`, weight [Rq + Rk + Rv, C];
    q_proj's forward computes all three and keeps k's and v's outputs for the next two calls with
    the same x (the attention calls them in a row with one tensor), which return their slices;
  - an MLP's gate_proj, up_proj (a shared expert, DeepSeek's dense layers) with SiLU:
    :class:`FusedMLP`, weight [2I, C] (gate first), then the C SiLU-and-product (csrc/expert.c
    ``silu_mul``, the routed experts' code) and down_proj: the MLP's forward in three calls.
Each module keeps its own stored weight as a row slice (a view) of the fused one, so prefill, the
reference path (``DensePath.reference``) and the compiled path compute from the same values as the
fused decode. Quantising the concatenation equals quantising each weight (groups lie within a row).

Precision: the products are the same kernel on the same rows (bit-equal to unfused); SiLU is libm's
expf against torch's Sleef (~1 ulp), so a fused MLP differs from the module's own forward by ~1e-7.
The reference is the modules' own forwards (``DensePath.reference = True``).
"""

from __future__ import annotations

import torch
from torch import nn

from moespec.kernels import native, spin
from moespec.kernels.lowbit import LowBitWeight
from moespec.kernels.swiglu import is_silu


def row_slices(w, sizes: list[int]) -> list:
    """``w`` [sum(sizes), C] (tensor or LowBitWeight) cut into consecutive row blocks, as views."""
    out, r0 = [], 0
    for n in sizes:
        r1 = r0 + n
        if isinstance(w, LowBitWeight):
            per, g = w.cols * w.bits // 8, w.groups
            out.append(LowBitWeight(w.bits, n, w.cols, w.group_size, w.codes[r0 * per : r1 * per],
                                    w.scales[r0 * g : r1 * g], w.zeros[r0 * g : r1 * g]))
        else:
            out.append(w[r0:r1])
        r0 = r1
    return out


def qkv_groups(model: nn.Module, linears: set[nn.Module]) -> list[tuple[nn.Module, list[nn.Linear]]]:
    """(attention, [q_proj, k_proj, v_proj]) of every attention whose three projections are in
    ``linears`` and read the same number of features."""
    out = []
    for m in model.modules():
        parts = [getattr(m, n, None) for n in ("q_proj", "k_proj", "v_proj")]
        if all(p in linears for p in parts) and len({p.in_features for p in parts}) == 1:
            out.append((m, parts))
    return out


def mlp_groups(model: nn.Module, linears: set[nn.Module]) -> list[tuple[nn.Module, list[nn.Linear]]]:
    """(mlp, [gate_proj, up_proj]) of every SiLU MLP (down(silu(gate(x)) * up(x))) whose three
    linears are in ``linears``, without biases on gate/up."""
    out = []
    for m in model.modules():
        parts = [getattr(m, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if (all(p in linears for p in parts) and is_silu(getattr(m, "act_fn", None))
                and parts[0].out_features == parts[1].out_features and parts[0].bias is None
                and parts[1].bias is None):
            out.append((m, parts[:2]))
    return out


class FusedQKV:
    """One attention's q/k/v as one bound product (module docstring).

    Args:
        path: the DensePath (its ``reference`` flag and ``calls`` counter).
        parts: [q_proj, k_proj, v_proj].
        fused: the stored fused weight [Rq + Rk + Rv, C].
        limit: the most tokens the kernels take (more: each module's own forward).
    """

    def __init__(self, path, parts: list[nn.Linear], fused, limit: int) -> None:
        self.path, self.limit = path, limit
        self.bound = spin.BoundWeight(fused)
        self.sizes = [p.out_features for p in parts]
        biases = [p.bias for p in parts]
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else torch.zeros(n) for b, n in zip(biases, self.sizes)])
        self._kept: tuple[torch.Tensor, list[torch.Tensor]] | None = None  # (x, [k out, v out])

    def wrap(self, parts: list[nn.Linear]) -> None:
        """Give q/k/v their fused forwards over the forwards install_dense gave them."""
        for i, module in enumerate(parts):
            module.forward = self._forward(i, module.forward)

    def _forward(self, i: int, own):
        def forward(x: torch.Tensor) -> torch.Tensor:
            if i > 0:
                kept = None if torch.compiler.is_compiling() else self._kept
                if kept is not None and kept[0] is x:
                    y = kept[1][i - 1]
                    if i == 2:
                        self._kept = None
                    return y
                return own(x)
            x2 = x.reshape(-1, x.shape[-1])  # [T, C]
            if (self.path.reference or x2.shape[0] > self.limit or torch.compiler.is_compiling()
                    or torch.get_num_threads() > 1):
                self._kept = None
                return own(x)
            self.path.calls += 1
            y = self.bound.linear(x2.float().contiguous(), spin.active())  # [T, Rq + Rk + Rv] float32
            if x.dtype != torch.float32:
                y = y.to(x.dtype)
            if self.bias is not None:
                y = y + self.bias
            q, k, v = (t.view(*x.shape[:-1], t.shape[-1]) for t in torch.split(y, self.sizes, dim=-1))
            self._kept = (x, [k, v])
            return q

        return forward


class FusedMLP:
    """One SiLU MLP's gate/up as one bound product, then SiLU-and-product and down (module docstring).

    Args:
        path: the DensePath; mlp: the MLP module (its down_proj keeps install_dense's forward).
        fused: the stored fused weight [2I, C] (gate rows first).
        limit: the most tokens the kernels take.
    """

    def __init__(self, path, mlp: nn.Module, fused, limit: int) -> None:
        self.path, self.mlp, self.limit = path, mlp, limit
        self.bound = spin.BoundWeight(fused)
        self.inter = mlp.gate_proj.out_features

    def wrap(self) -> None:
        """Replace the MLP's forward (this instance only)."""
        own = self.mlp.forward
        lib, inter, bound, down = native.library(), self.inter, self.bound, self.mlp.down_proj

        def forward(x: torch.Tensor) -> torch.Tensor:
            x2 = x.reshape(-1, x.shape[-1])  # [T, H]
            if (self.path.reference or x2.shape[0] > self.limit or torch.compiler.is_compiling()
                    or torch.get_num_threads() > 1 or x.dtype not in (torch.float32, torch.bfloat16)):
                return own(x)
            self.path.calls += 1
            gu = bound.linear(x2.float().contiguous(), spin.active())  # [T, 2I] float32
            h = torch.empty(x2.shape[0], inter)  # [T, I]
            lib.silu_mul(gu.data_ptr(), x2.shape[0], inter, h.data_ptr(), int(x.dtype == torch.bfloat16))
            return down(h.to(x.dtype).view(*x.shape[:-1], inter))  # [..., H]

        self.mlp.forward = forward
