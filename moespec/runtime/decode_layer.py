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

import functools
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
        steps: each wrapped layer's :class:`LeanStep` (runtime/compile.py compiles its attention).
        reference: True runs every layer's own forward.
        calls: lean layer steps so far (tests check the lean path ran).
    """

    layers: list[nn.Module] = field(default_factory=list)
    steps: dict[nn.Module, LeanStep] = field(default_factory=dict)
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
        self.steps.clear()
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


@dataclass(frozen=True)
class LeanShape:
    """The constants of one lean attention: query / key-value heads, head dim, SDPA scale, per-head
    q/k norms. Layers of one model share one instance (:func:`_shape`): the compiled segment
    (runtime/compile.py) guards on its values, the same for every layer."""

    hq: int
    hk: int
    d: int
    scale: float
    qk_norm: bool


@functools.cache
def _shape(hq: int, hk: int, d: int, scale: float, qk_norm: bool) -> LeanShape:
    return LeanShape(hq, hk, d, scale, qk_norm)


@dataclass(frozen=True)
class LeanStep:
    """One layer's lean step, in parts (runtime/compile.py compiles ``attention`` once per shape).

    Attributes:
        shape: the attention's constants.
        modules: (input norm, q_proj, k_proj, v_proj, q_norm, k_norm, o_proj); q/k norms None
            without per-head norms.
        post_norm, mlp: the router-input norm and the MoE block (or MLP), called eagerly.
        store_for: (hidden_states, args, kwargs) -> (DynamicLayer, (cos, sin)) when this call can
            take the lean step, else None (module docstring: anything else runs the own forward).
    """

    shape: LeanShape
    modules: tuple
    post_norm: nn.Module
    mlp: nn.Module
    store_for: object


def lean_attention(shape: LeanShape, modules: tuple, hidden: torch.Tensor, keys: torch.Tensor,
                   values: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """A decode step's input norm, attention with its KV append and residual add (module docstring).

    Args: hidden [1, 1, H]; keys, values [1, Hk, L, D] (the layer's cache so far); cos, sin'
    [1, 1, 1, D] (``DecodePath.rope``). Returns (h [1, 1, H], keys, values [1, Hk, L + 1, D]): the
    residual stream after attention and the caches with the new position appended (new tensors,
    as DynamicLayer.update's torch.cat). Pure in its tensors: compiled once for every layer of a
    shape (runtime/compile.py).
    """
    in_norm, q_proj, k_proj, v_proj, q_norm, k_norm, o_proj = modules
    hq, hk, d = shape.hq, shape.hk, shape.d
    x = in_norm.forward(hidden)  # [1, 1, H]
    q = q_proj.forward(x)  # [1, 1, Hq * D]
    k = k_proj.forward(x)
    v = v_proj.forward(x).reshape(1, hk, 1, d)
    if shape.qk_norm:
        q = q_norm.forward(q.view(1, 1, hq, d))
        k = k_norm.forward(k.view(1, 1, hk, d))
    qk = torch.cat([q.reshape(1, hq, 1, d), k.reshape(1, hk, 1, d)], dim=1)  # [1, Hq + Hk, 1, D]
    qk = qk * cos + qk.roll(d // 2, -1) * sin
    keys = torch.cat([keys, qk[:, hq:]], dim=-2)  # [1, Hk, L + 1, D]
    values = torch.cat([values, v], dim=-2)
    gqa = {"enable_gqa": True} if hq != hk else {}
    out = F.scaled_dot_product_attention(qk[:, :hq], keys, values, attn_mask=None, dropout_p=0.0,
                                         scale=shape.scale, is_causal=False, **gqa)  # [1, Hq, 1, D]
    return hidden + o_proj.forward(out.reshape(1, 1, hq * d)), keys, values


def _forward(path: DecodePath, layer: nn.Module, own, qk_norm: bool):
    attn = layer.self_attn
    idx, d = attn.layer_idx, attn.head_dim
    hq = attn.q_proj.out_features // d
    hk = attn.k_proj.out_features // d
    shape = _shape(hq, hk, d, float(attn.scaling), qk_norm)
    # transformers' sdpa integration runs one query with enable_gqa only for D <= 256 (else pack_gqa)
    lean_heads = d <= 256 and d % 2 == 0
    in_norm, post_norm, mlp = layer.input_layernorm, layer.post_attention_layernorm, layer.mlp
    q_proj, k_proj, v_proj, o_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
    q_norm, k_norm = (attn.q_norm, attn.k_norm) if qk_norm else (None, None)
    modules = (in_norm, q_proj, k_proj, v_proj, q_norm, k_norm, o_proj)
    # the modules the lean step calls past nn.Module.__call__: one with a hook on it (a profiler's,
    # a test's Ctrl-C, a user's) sends the step to the layer's own forward, so every hook still runs
    called = tuple(m for m in (*modules, attn, post_norm, mlp) if m is not None)

    def hooked() -> bool:
        return bool(_global_forward_hooks or _global_forward_pre_hooks
                    or any(m._forward_hooks or m._forward_pre_hooks for m in called))

    def store_for(hidden_states, args, kwargs):
        if (args or path.reference or not lean_heads or hidden_states.shape[0] != 1
                or hidden_states.shape[1] != 1 or kwargs.get("attention_mask") is not None
                or not kwargs.keys() <= _DECODE_KWARGS or any(kwargs.get(k) for k in _OUTPUTS)
                or torch.compiler.is_compiling() or hooked()):
            return None
        kv = kwargs.get("cache")
        kv = kwargs.get("past_key_values") if kv is None else kv
        position_embeddings = kwargs.get("position_embeddings")
        if kv is None or position_embeddings is None:
            return None
        store = _lean_cache_layer(kv, idx)
        return None if store is None else (store, position_embeddings)

    def forward(hidden_states, *args, **kwargs):
        found = store_for(hidden_states, args, kwargs)
        if found is None:
            return own(hidden_states, *args, **kwargs)
        store, position_embeddings = found
        path.calls += 1
        cos, sin = path.rope(*position_embeddings)
        h, store.keys, store.values = lean_attention(shape, modules, hidden_states, store.keys,
                                                     store.values, cos, sin)
        out = mlp.forward(post_norm.forward(h))
        return h + (out[0] if isinstance(out, tuple) else out)

    path.steps[layer] = LeanStep(shape, modules, post_norm, mlp, store_for)
    return forward
