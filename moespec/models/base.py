"""The adapter interface and the default (Mixtral/Qwen-style) behaviour.

Shapes: T tokens, E experts, K top-k, H hidden, I expert intermediate.

Experts in memory follow transformers 5's fused layout: gate_up_proj [E, 2I, H] (gate rows
first, then up rows: "halves") and down_proj [E, H, I]; the adapter's ExpertLayout (layout.py)
says how one expert is packed and computed. On disk most checkpoints keep one tensor per expert
and projection; the adapter maps disk names to (layer, expert, part).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from moespec.errors import OptionError
from moespec.models.layout import ExpertKey, ExpertLayout
from moespec.models.quant import DEFAULT_GROUP_SIZE, ExpertQuant
from moespec.models.quant_layout import QuantLayout

# Parts of an expert as stored on disk. "gate_up"/"down" with expert None are fused [E, ...] tensors;
# families with other parts (biases, MXFP4 blocks/scales) name them in their layout.
PARTS = ("gate", "up", "down", "gate_up")


@dataclass(frozen=True)
class Routing:
    """A routing decision for T tokens.

    Attributes:
        ids: [T, K] int64 expert ids.
        weights: [T, K] gate weights (the dtype the architecture multiplies expert outputs with).
        logits: [T, E] router logits, or None when the routing was replayed or speculated without them.
    """

    ids: torch.Tensor
    weights: torch.Tensor
    logits: torch.Tensor | None = None


FLOAT_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
                "fp32": torch.float32, "float32": torch.float32}


def expert_quant(expert_dtype: str, dtype: torch.dtype, group_size: int | None) -> ExpertQuant | None:
    """Parse ``--expert-dtype``: the low-bit format it asks for, or None to keep the checkpoint's experts.

    Raises:
        OptionError: an unknown value, a float dtype other than the compute dtype ``dtype``, or a
            --group-size given without int8/int4.
    """
    if expert_dtype in (q.value for q in ExpertQuant):
        return ExpertQuant(expert_dtype)
    if group_size is not None:
        raise OptionError(f"--group-size {group_size} applies to --expert-dtype int8/int4, not {expert_dtype}",
                          "add --expert-dtype int4 (or int8), or drop --group-size")
    if expert_dtype == "auto":
        return None
    want = FLOAT_DTYPES.get(expert_dtype)
    if want is None:
        raise OptionError(f"--expert-dtype {expert_dtype!r} is not valid",
                          f"choose one of: auto, {', '.join(q.value for q in ExpertQuant)}, {', '.join(FLOAT_DTYPES)}")
    if want != dtype:
        name = str(dtype).removeprefix("torch.")
        raise OptionError(f"--expert-dtype {expert_dtype} differs from the compute dtype {name}",
                          f"use --expert-dtype auto, or --dtype {expert_dtype} with --expert-dtype {expert_dtype}")
    return None


class MoeAdapter:
    """Default adapter: softmax -> top-k (-> renormalise) routers, SwiGLU experts, no shared expert.

    Subclasses set ``model_types`` and override only what differs.
    """

    model_types: ClassVar[tuple[str, ...]] = ()
    # On-disk names of the per-expert projections, mapped to store parts.
    disk_part_names: ClassVar[dict[str, str]] = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    # Regex fragment of the MoE block's attribute name on disk (before renaming).
    disk_block_pattern: ClassVar[str] = r"mlp"
    # Attribute of the router in the original block; the offloaded block always names it `gate`.
    router_attr: ClassVar[str] = "gate"
    # The original block returns (output, router_scores) rather than a tensor (GPT-OSS).
    returns_router_scores: ClassVar[bool] = False

    def __init__(self, config) -> None:
        self.config = config

    # --- shape facts -------------------------------------------------------------------
    def num_experts(self) -> int:
        """E: routed experts per MoE layer."""
        return int(getattr(self.config, "num_experts", None) or self.config.num_local_experts)

    def top_k(self) -> int:
        """K: experts per token."""
        return int(self.config.num_experts_per_tok)

    def expert_intermediate(self) -> int:
        """I: intermediate size of one routed expert."""
        return int(getattr(self.config, "moe_intermediate_size", None) or self.config.intermediate_size)

    def layout(self, dtype: torch.dtype = torch.float32, expert_dtype: str = "auto",
               group_size: int | None = None) -> ExpertLayout:
        """The packed layout of one expert for a model computing in ``dtype``.

        ``expert_dtype`` (``--expert-dtype``): "auto" or the compute dtype keeps the checkpoint's
        experts; "int8" / "int4" quantises them group-wise at load (``group_size`` columns per scale,
        default :data:`moespec.models.quant.DEFAULT_GROUP_SIZE`) into a :class:`QuantLayout` row;
        "w8a8" / "w4a8" store the same rows and quantise activations in the CPU kernels (not exact).
        Families whose checkpoints ship packed experts (GPT-OSS MXFP4) override this.

        Raises:
            OptionError: an unknown --expert-dtype, a float dtype other than --dtype, a --group-size
                the kernels cannot take (or given without int8/int4), H or I not multiples of 16.
        """
        shape = dict(hidden=int(self.config.hidden_size), intermediate=self.expert_intermediate())
        quant = expert_quant(expert_dtype, dtype, group_size)
        if quant is None:
            return ExpertLayout(**shape)
        return QuantLayout(**shape, bits=quant.bits, group_size=group_size or DEFAULT_GROUP_SIZE,
                           act_int8=quant.act_int8)

    def expert_converter(self, layout: ExpertLayout):
        """A callable (key, tensor, name) -> [(key, tensor, name), ...] applied to expert tensors at load.

        The default passes every tensor through, or quantises it for a QuantLayout (int8/int4);
        GPT-OSS pairs MXFP4 blocks with scales and dequantises them when the layout is dense.
        """
        if isinstance(layout, QuantLayout):
            return layout.converter()
        return lambda key, tensor, name: [(key, tensor, name)]

    def is_moe_block(self, module: nn.Module) -> bool:
        """True when ``module`` (a decoder layer's mlp) is a sparse MoE block."""
        return hasattr(module, "experts") and hasattr(module, self.router_attr)

    # --- routing -------------------------------------------------------------------------
    def route(self, block: nn.Module, hidden: torch.Tensor) -> Routing:
        """True routing of ``block`` for router input ``hidden`` [T, H]: runs the model's own router."""
        logits, weights, ids = block.gate(hidden)
        return Routing(ids=ids, weights=weights, logits=logits)

    def select(self, block: nn.Module, logits: torch.Tensor) -> Routing:
        """Routing from logits [T, E] by this family's rule (softmax in fp32, top-k, renormalise).

        Used by predictors, which produce logits for a layer without running it.
        """
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
        top, ids = torch.topk(probs, self.top_k(), dim=-1)  # [T, K]
        if getattr(self.config, "norm_topk_prob", True):
            top = top / top.sum(dim=-1, keepdim=True)
        return Routing(ids=ids, weights=self.cast_weights(top, logits), logits=logits)

    def cast_weights(self, weights: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Cast gate weights as the family's router does (Qwen/OLMoE: to the logits dtype)."""
        return weights.to(logits.dtype)

    def router_logits(self, block: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """Router logits [T, E] of ``block`` for input [T, H] (the linear map H -> E)."""
        return F.linear(hidden, block.gate.weight)

    def shared_output(self, block: nn.Module, hidden: torch.Tensor) -> torch.Tensor | None:
        """Output [T, H] of the resident shared expert(s), or None when the family has none."""
        return None

    # --- checkpoint names -------------------------------------------------------------------
    def expert_key(self, name: str) -> ExpertKey | None:
        """Map a checkpoint tensor name to its place in the expert store, or None for a dense tensor."""
        parts = "|".join(map(re.escape, self.disk_part_names))
        m = re.fullmatch(
            rf"(?:model\.)?layers\.(\d+)\.{self.disk_block_pattern}\.experts\.(\d+)\.({parts})\.weight", name
        )
        if m:
            return ExpertKey(int(m.group(1)), int(m.group(2)), self.disk_part_names[m.group(3)])
        m = re.fullmatch(rf"(?:model\.)?layers\.(\d+)\.{self.disk_block_pattern}\.experts\.(gate_up_proj|down_proj)", name)
        if m:
            return ExpertKey(int(m.group(1)), None, "gate_up" if m.group(2) == "gate_up_proj" else "down")
        return None

    def dense_name(self, name: str) -> str:
        """The in-memory parameter name of a dense checkpoint tensor."""
        return name
