"""A decode step's decoder layer in few tensor ops: the same operations as transformers', less Python.

Shapes: H hidden, Hq / Hk query / key-value heads, D head dim, L cached positions.

A decode step (one token, batch 1) of a decoder layer whose attention is one of
:data:`LEAN_ATTENTIONS` (Qwen2-MoE, Qwen3-MoE, Mixtral: q/k/v projections, optional per-head q/k
RMSNorms, rotary embedding, SDPA, o_proj) runs a forward of its own (this instance only):
  - every submodule is called through its ``forward`` (moespec's norm / dense forwards where they
    are installed), not ``nn.Module.__call__``: no hook checks, no ``__getattr__`` walk per call;
  - q and k [1, Hq + Hk, 1, D] get the rotary embedding in one pass: x * cos + roll(x, D/2) * sin'
    with sin' = (-sin[:D/2], sin[D/2:]) made once per step, elementwise the same products and sums
    as transformers' ``x * cos + rotate_half(x) * sin`` (negating a factor is exact), so bit-equal;
  - the new key/value position is appended to the ``DynamicLayer`` as its own ``update`` does
    (``torch.cat`` on the position axis), and SDPA is called as transformers' sdpa integration calls
    it for one query without a mask (``enable_gqa`` when heads are grouped);
  - with one token, [1, 1, Hq, D] and [1, Hq, 1, D] are one memory layout: views, no transposes.
Anything else (prefill, a mask, another cache class, a sliding-window layer, extra kwargs, under
torch.compile, a forward hook on any module the step calls, the reference) runs the layer's own
forward. The reference, ``DecodePath.reference =
True``, is the layers' own forwards; tests compare the logits bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

from moespec.runtime.forwards import restore_forwards

# attention class name -> it has per-head q_norm / k_norm (Qwen3)
LEAN_ATTENTIONS = {"Qwen2MoeAttention": False, "MixtralAttention": False, "Qwen3MoeAttention": True}
# the keyword arguments a decoder layer gets in a plain forward; any other sends it to its own forward
_DECODE_KWARGS = frozenset({"attention_mask", "position_ids", "cache", "past_key_values", "use_cache",
                            "position_embeddings", "output_router_logits", "output_attentions"})
_OUTPUTS = ("output_router_logits", "output_attentions")  # asked for (True): the own forward, whose hooks record


@dataclass
class DecodePath:
    """The lean decode layers of one model instance (module docstring).

    Attributes:
        layers: the wrapped decoder layers.
        reference: True runs every layer's own forward.
        calls: lean layer steps so far (tests check the lean path ran).
    """

    layers: list[nn.Module] = field(default_factory=list)
    reference: bool = False
    calls: int = 0
    _undo: list[tuple[nn.Module, object]] = field(default_factory=list)
    _rope: tuple = (None, None, None)  # (cos of the last step, cos [1, 1, 1, D], sin' [1, 1, 1, D])

    def rope(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin') [1, 1, 1, D] for a step's position embeddings cos, sin [1, 1, D]; made once
        per step (every layer of a step gets the same cos tensor)."""
        last, c, s = self._rope
        if last is not cos:
            half = sin.shape[-1] // 2
            c = cos.unsqueeze(1)
            s = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1).unsqueeze(1)
            self._rope = (cos, c, s)
        return c, s

    def uninstall(self) -> None:
        """Put the layers' own forwards back."""
        restore_forwards(self._undo)
        self.layers.clear()
        self._rope = (None, None, None)


def install_decode_layers(model: nn.Module) -> DecodePath:
    """Give every decoder layer of ``model`` with a :data:`LEAN_ATTENTIONS` attention under SDPA, and
    not sliding-window, the lean decode step (module docstring)."""
    path = DecodePath()
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return path
    for layer in model.model.layers:
        attn = getattr(layer, "self_attn", None)
        qk_norm = LEAN_ATTENTIONS.get(type(attn).__name__)
        if qk_norm is None:  # sliding-window layers: their cache layer or mask sends them to their own
            continue
        path.layers.append(layer)
        path._undo.append((layer, layer.__dict__.get("forward")))
        layer.forward = _forward(path, layer, layer.forward, qk_norm)
    return path


def _lean_cache_layer(cache, idx: int):
    """The DynamicLayer of ``cache`` for layer ``idx`` when the lean step can append to it, else None."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    if type(cache) is not DynamicCache or getattr(cache, "offloading", False):
        return None
    layers = cache.layers
    if idx >= len(layers):
        return None
    layer = layers[idx]
    return layer if type(layer) is DynamicLayer and layer.is_initialized else None


def _forward(path: DecodePath, layer: nn.Module, own, qk_norm: bool):
    attn = layer.self_attn
    idx, d, scale = attn.layer_idx, attn.head_dim, attn.scaling
    hq = attn.q_proj.out_features // d
    hk = attn.k_proj.out_features // d
    gqa = {"enable_gqa": True} if hq != hk else {}
    half = d // 2
    # transformers' sdpa integration runs one query with enable_gqa only for D <= 256 (else pack_gqa)
    lean_heads = d <= 256 and d % 2 == 0
    in_norm, post_norm, mlp = layer.input_layernorm, layer.post_attention_layernorm, layer.mlp
    q_proj, k_proj, v_proj, o_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
    q_norm, k_norm = (attn.q_norm, attn.k_norm) if qk_norm else (None, None)
    # the modules the lean step calls past nn.Module.__call__: one with a hook on it (a profiler's,
    # a test's Ctrl-C, a user's) sends the step to the layer's own forward, so every hook still runs
    called = tuple(m for m in (in_norm, attn, q_proj, k_proj, v_proj, q_norm, k_norm, o_proj, post_norm, mlp)
                   if m is not None)

    def hooked() -> bool:
        return bool(_global_forward_hooks or _global_forward_pre_hooks
                    or any(m._forward_hooks or m._forward_pre_hooks for m in called))

    def forward(hidden_states, *args, **kwargs):
        store = None
        if (not args and not path.reference and lean_heads and hidden_states.shape[0] == 1
                and hidden_states.shape[1] == 1 and kwargs.get("attention_mask") is None
                and kwargs.keys() <= _DECODE_KWARGS and not any(kwargs.get(k) for k in _OUTPUTS)
                and not torch.compiler.is_compiling() and not hooked()):
            kv = kwargs.get("cache")
            kv = kwargs.get("past_key_values") if kv is None else kv
            position_embeddings = kwargs.get("position_embeddings")
            if kv is not None and position_embeddings is not None:
                store = _lean_cache_layer(kv, idx)
        if store is None:
            return own(hidden_states, *args, **kwargs)
        path.calls += 1
        x = in_norm.forward(hidden_states)  # [1, 1, H]
        q = q_proj.forward(x)  # [1, 1, Hq * D]
        k = k_proj.forward(x)
        v = v_proj.forward(x).reshape(1, hk, 1, d)
        if qk_norm:
            q = q_norm.forward(q.view(1, 1, hq, d))
            k = k_norm.forward(k.view(1, 1, hk, d))
        qk = torch.cat([q.reshape(1, hq, 1, d), k.reshape(1, hk, 1, d)], dim=1)  # [1, Hq + Hk, 1, D]
        cos, sin = path.rope(*position_embeddings)
        qk = qk * cos + qk.roll(half, -1) * sin
        store.keys = torch.cat([store.keys, qk[:, hq:]], dim=-2)  # [1, Hk, L, D]
        store.values = torch.cat([store.values, v], dim=-2)
        out = F.scaled_dot_product_attention(qk[:, :hq], store.keys, store.values, attn_mask=None,
                                             dropout_p=0.0, scale=scale, is_causal=False, **gqa)  # [1, Hq, 1, D]
        h = hidden_states + o_proj.forward(out.reshape(1, 1, hq * d))  # [1, 1, H]
        out = mlp.forward(post_norm.forward(h))
        return h + (out[0] if isinstance(out, tuple) else out)

    return forward
