"""Softmax routers of one model instance: the selection after the router's product in one native call.

Shapes: T tokens, H hidden, E experts, K top-k.

The routers of :data:`ROUTER_CLASSES` (transformers' Qwen2-MoE, Qwen3-MoE, OLMoE and Mixtral
top-k routers) compute logits = x W^T, softmax in float32, top-k, and renormalise the top-k
(Qwen/OLMoE when ``norm_topk_prob``; Mixtral always). Each gets a forward of its own (this instance
only): for one token in float32 on the CPU with the native kernels loaded, the same ``F.linear`` for
the logits (bit-equal), then softmax, top-k and the renormalisation in one call
(csrc/router.c ``router_topk``: within a few ulp of torch's; a tie in the top-k: the own forward); anything else (a prefill, bfloat16,
CUDA, under torch.compile, the reference) the router's own forward.

The reference: ``RouterPath.reference = True`` runs every router's own forward (tests compare them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from moespec.kernels import native
from moespec.runtime.forwards import restore_forwards

# router class name -> renormalises the top-k always (True), or as its ``norm_topk_prob`` says (None)
ROUTER_CLASSES = {"Qwen2MoeTopKRouter": None, "Qwen3MoeTopKRouter": None, "OlmoeTopKRouter": None,
                  "MixtralTopKRouter": True}


@dataclass
class RouterPath:
    """The routers of one model instance (module docstring).

    Attributes:
        routers: the wrapped router modules.
        reference: True runs every router's own forward.
        calls: native selections so far (tests check the fast path ran).
        ties: tokens sent to the router's own forward because probabilities tied (router.c).
    """

    routers: list[nn.Module] = field(default_factory=list)
    reference: bool = False
    calls: int = 0
    ties: int = 0
    _undo: list[tuple[nn.Module, object]] = field(default_factory=list)

    def uninstall(self) -> None:
        """Put the routers' own forwards back."""
        restore_forwards(self._undo)
        self.routers.clear()


def install_routers(model: nn.Module) -> RouterPath:
    """Wrap every router of :data:`ROUTER_CLASSES` in ``model`` (module docstring). Weights are read
    at each call (loading replaces the parameters after this runs)."""
    path = RouterPath()
    for module in model.modules():
        name = type(module).__name__
        if name not in ROUTER_CLASSES or not all(hasattr(module, a) for a in ("weight", "top_k", "hidden_dim")):
            continue
        renorm = ROUTER_CLASSES[name]
        if renorm is None:
            if not hasattr(module, "norm_topk_prob"):
                continue
            renorm = bool(module.norm_topk_prob)
        path.routers.append(module)
        path._undo.append((module, module.__dict__.get("forward")))
        module.forward = _forward(path, module, module.forward, renorm)
    return path


def _forward(path: RouterPath, module: nn.Module, own, renorm: bool):
    k, hidden = int(module.top_k), int(module.hidden_dim)

    def forward(hidden_states: torch.Tensor):
        w = module.weight
        lib = native.library()
        if (path.reference or lib is None or hidden_states.numel() != hidden or hidden_states.dtype != torch.float32
                or w.dtype != torch.float32 or hidden_states.device.type != "cpu" or w.device.type != "cpu"
                or torch.compiler.is_compiling()):
            return own(hidden_states)
        logits = F.linear(hidden_states.reshape(1, hidden), w).contiguous()  # [1, E], as the router's own
        weights = torch.empty(1, k)  # [1, K] float32 (the logits' dtype: no cast)
        ids = torch.empty(1, k, dtype=torch.long)  # [1, K]
        if lib.router_topk(logits.data_ptr(), 1, logits.shape[-1], k, int(renorm), weights.data_ptr(), ids.data_ptr()):
            path.ties += 1
            return own(hidden_states)  # a tie: torch.topk's choice and order are its own (router.c)
        path.calls += 1
        return logits, weights, ids

    return forward
