"""GPT-OSS: differs by a biased router (top-K of the raw logits, softmax over those K only), experts
with biases and a clamped SwiGLU (gpt_oss_experts.py), and MXFP4 experts on the Hub.

Shapes: T tokens, E experts, K top-k, H hidden, I expert intermediate.

Names: the block is `mlp` with children `router` and `experts` (fused on disk:
experts.gate_up_proj [E, H, 2I] + _bias [E, 2I], experts.down_proj [E, I, H] + _bias [E, H]; or,
in MXFP4 checkpoints, experts.{gate_up,down}_proj_{blocks,scales}). The offloaded block registers
the router as `gate`, so `mlp.router.*` is loaded as `mlp.gate.*`.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from moespec.errors import CheckpointError, OptionError
from moespec.models import mxfp4
from moespec.models.base import MoeAdapter, Routing, expert_quant
from moespec.models.gpt_oss_experts import GptOssLayout, GptOssMxfp4Layout
from moespec.models.layout import ExpertKey, ExpertLayout
from moespec.models.quant import ExpertQuant

_EXPERT_NAME = re.compile(r"(?:model\.)?layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj(_bias|_blocks|_scales)?")


class GptOssAdapter(MoeAdapter):
    """GPT-OSS-20B/120B."""

    model_types = ("gpt_oss",)
    router_attr = "router"
    returns_router_scores = True  # GptOssMLP returns (output, router_scores)

    def is_mxfp4(self) -> bool:
        """True when config.json's quantization_config says the experts are stored as MXFP4."""
        qc = getattr(self.config, "quantization_config", None) or {}
        method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
        return str(getattr(method, "value", method)) == "mxfp4"

    def layout(self, dtype: torch.dtype = torch.float32, expert_dtype: str = "auto",
               group_size: int | None = None) -> ExpertLayout:
        """MXFP4 rows for MXFP4 checkpoints with --expert-dtype auto, dense rows otherwise.

        int8/int4 are refused: GPT-OSS ships its experts as MXFP4 (4.25 bits per weight), which
        moespec already moves packed, and its transposed, biased rows have no quantised layout.

        Raises:
            OptionError: --expert-dtype int8/int4, or a dtype other than the compute dtype (--dtype).
        """
        shape = dict(hidden=int(self.config.hidden_size), intermediate=self.expert_intermediate(),
                     alpha=float(self.config.swiglu_alpha), limit=float(self.config.swiglu_limit))
        if expert_dtype in (q.value for q in ExpertQuant):
            raise OptionError(f"--expert-dtype {expert_dtype} is not supported for gpt_oss experts",
                              "use --expert-dtype auto: GPT-OSS experts stay MXFP4 (4.25 bits) and move packed")
        expert_quant(expert_dtype, dtype, group_size)  # validates the float names and --group-size
        if expert_dtype != "auto":  # the compute dtype: MXFP4 is dequantised once at load
            return GptOssLayout(**shape)
        if self.is_mxfp4():
            if shape["hidden"] % mxfp4.BLOCK or shape["intermediate"] % mxfp4.BLOCK:
                raise CheckpointError(f"MXFP4 experts need H and I divisible by {mxfp4.BLOCK}, "
                                      f"got H={shape['hidden']}, I={shape['intermediate']}")
            return GptOssMxfp4Layout(**shape, bias_dtype=dtype)
        return GptOssLayout(**shape)

    def expert_converter(self, layout: ExpertLayout):
        """With a dense layout, MXFP4 blocks wait for their scales, then load dequantised ([E, H, 2I], [E, I, H])."""
        if isinstance(layout, GptOssMxfp4Layout):
            return super().expert_converter(layout)
        pending: dict[tuple[int, str], dict[str, tuple[torch.Tensor, str]]] = {}

        def convert(key: ExpertKey, tensor: torch.Tensor, name: str):
            proj, _, kind = key.part.rpartition("_")
            if kind not in ("blocks", "scales"):
                return [(key, tensor, name)]
            got = pending.setdefault((key.layer, proj), {})
            got[kind] = (tensor, name)
            if len(got) < 2:
                return []
            del pending[(key.layer, proj)]
            (blocks, bname), (scales, _) = got["blocks"], got["scales"]
            if tuple(blocks.shape[:-1]) != tuple(scales.shape):
                raise CheckpointError(f"tensor {bname} has shape {tuple(blocks.shape)}, which does not match "
                                      f"its scales {tuple(scales.shape)}")
            dense = mxfp4.dequantize(blocks, scales, torch.float32).transpose(1, 2)  # [E, cols, rows] as transformers
            return [(ExpertKey(key.layer, None, proj), dense, bname)]

        return convert

    # --- routing -------------------------------------------------------------------------
    def router_logits(self, block: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """Differs: the router has a bias."""
        return F.linear(hidden, block.gate.weight, block.gate.bias)  # [T, E]

    def select(self, block: nn.Module, logits: torch.Tensor) -> Routing:
        """Differs: top-K of the raw logits, then softmax over those K only (in the logits dtype)."""
        top, ids = torch.topk(logits, self.top_k(), dim=-1)  # [T, K]
        weights = F.softmax(top, dim=1, dtype=top.dtype)  # [T, K]
        return Routing(ids=ids, weights=weights, logits=logits)

    # --- checkpoint names ------------------------------------------------------------------
    def expert_key(self, name: str) -> ExpertKey | None:
        """Fused experts only: experts.{gate_up,down}_proj[_bias|_blocks|_scales] -> part e.g. "gate_up_bias"."""
        m = _EXPERT_NAME.fullmatch(name)
        if m is None:
            return None
        return ExpertKey(int(m.group(1)), None, m.group(2) + (m.group(3) or ""))

    def dense_name(self, name: str) -> str:
        """The router is registered as `gate` in the offloaded block."""
        return name.replace(".mlp.router.", ".mlp.gate.")
