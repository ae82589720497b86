"""RMSNorms of one model instance through the native kernel, and r_l recorded by the norm itself.

Shapes: H hidden; x [..., H].

Every RMSNorm of a family this project runs (:data:`NORM_CLASSES`: all compute
weight * (x * rsqrt(mean(x^2) + eps)) in float32) gets a forward of its own (this instance only):
float32 on the CPU with the native kernels loaded, ``moespec.kernels.norm.rms_norm`` (one call
instead of five tensor ops); anything else (bfloat16, CUDA, under torch.compile, the reference)
the module's own forward.

The post-attention norm of MoE layer l also records its input, r_l (the residual stream after
attention), in ``runner.residual[l]`` for the predictors, in its forward: a forward pre-hook did
this before, and any hook sends every call of the module through torch's slow hook path.

The reference: ``NormPath.reference = True`` runs every norm's own forward (tests compare them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from moespec.kernels import norm as kn
from moespec.runtime.forwards import restore_forwards

NORM_CLASSES = ("Qwen2MoeRMSNorm", "Qwen3MoeRMSNorm", "MixtralRMSNorm", "OlmoeRMSNorm", "DeepseekV2RMSNorm",
                "DeepseekV3RMSNorm", "GptOssRMSNorm", "Glm4MoeLiteRMSNorm")


@dataclass
class NormPath:
    """The norms of one model instance (module docstring).

    Attributes:
        norms: the wrapped norm modules.
        reference: True runs every norm's own forward.
        calls: native norm calls so far (tests check the fast path ran).
    """

    norms: list[nn.Module] = field(default_factory=list)
    reference: bool = False
    calls: int = 0
    _undo: list[tuple[nn.Module, object]] = field(default_factory=list)

    def uninstall(self) -> None:
        """Put the modules' own forwards back (r_l is then no longer recorded)."""
        restore_forwards(self._undo)
        self.norms.clear()


def install_norms(model: nn.Module, runner, moe_layers: list[int]) -> NormPath:
    """Wrap every norm of ``model`` (module docstring); the post-attention norm of each layer in
    ``moe_layers`` records r_l into ``runner.residual``. Weights are read at each call (loading
    replaces the parameters after this runs)."""
    path = NormPath()
    recorders = {id(model.model.layers[i].post_attention_layernorm): i for i in moe_layers}
    for module in model.modules():
        layer = recorders.get(id(module))
        native = type(module).__name__ in NORM_CLASSES and hasattr(module, "variance_epsilon")
        if not native and layer is None:
            continue
        path.norms.append(module)
        path._undo.append((module, module.__dict__.get("forward")))
        module.forward = _forward(path, module, module.forward, native, runner, layer)
    return path


def _forward(path: NormPath, module: nn.Module, own, native: bool, runner, layer: int | None):
    def forward(x: torch.Tensor) -> torch.Tensor:
        if layer is not None:
            runner.residual[layer] = x  # r_l [.., H]
        w = module.weight
        if not native or path.reference or torch.compiler.is_compiling() or not kn.applies(x, w):
            return own(x)
        path.calls += 1
        return kn.rms_norm(x, w, module.variance_epsilon)

    return forward
