"""A one-token forward of the whole model in few Python calls: embedding, rotary, layers, norm, lm_head.

Shapes: H hidden, V vocabulary.

transformers' CausalLM and base-model forwards wrap a decode step in decorators (config defaults,
output capturing, deprecated keyword names, the tuple switch), build the attention masks, slice the
layer list and make two output records: ~1 ms per token here, around ~30 layers whose own Python
was already cut (decode_layer.py). For one new token, batch 1, no attention mask, a DynamicCache,
every layer full attention under SDPA, and nothing asked beyond the last logits, the mask
transformers builds is None (SDPA's causal mask is skipped for a single query), so
:meth:`ModelStep.logits` makes the same calls itself: the embedding row (or the one the token
start already looked up: runtime/layer/token_start.py), ``position_ids = [[past]]``, the rotary
embedding, every decoder layer's forward with the keywords the base model passes, the final norm,
lm_head. The same modules on the same values: the logits are bit-equal (tests/test_decode_model.py).

Anything else returns None and the caller runs ``model(...)``: a forward or pre-hook on any module
whose ``__call__`` is bypassed (a profiler's, a test's), torch.compile, a compiled dense path, output
options set in the config, another cache class, sliding-window or non-SDPA attention, and the
reference (``ModelStep.reference = True``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

_OUTPUT_FLAGS = ("output_router_logits", "output_hidden_states", "output_attentions")  # config: asked for


@dataclass
class ModelStep:
    """The one-token forward of one model instance (module docstring).

    Attributes:
        reference: True: :meth:`logits` always returns None (``model(...)`` runs).
        calls: one-token forwards it ran (tests check it ran).
    """

    model: nn.Module
    reference: bool = False
    calls: int = 0
    _hook_dicts: list = field(default_factory=list)
    _applies: bool = False

    def __post_init__(self) -> None:
        base = getattr(self.model, "model", None)
        config = getattr(self.model, "config", None)
        parts = [getattr(base, n, None) for n in ("embed_tokens", "rotary_emb", "norm", "layers")]
        head = getattr(self.model, "lm_head", None)
        if base is None or config is None or head is None or any(p is None for p in parts):
            return
        n = int(getattr(config, "num_hidden_layers", 0) or 0)
        types = getattr(config, "layer_types", None) or ["full_attention"] * n
        self._applies = (getattr(config, "_attn_implementation", None) == "sdpa" and n == len(base.layers)
                         and all(t == "full_attention" for t in types[:n])
                         and not getattr(config, "use_sliding_window", False))
        self._config = config
        self._embed, self._rotary, self._norm, layers = parts
        self._layers = list(layers[:n])
        self._head = head
        # every module whose __call__ the step bypasses: a hook on any sends the step to model(...)
        bypassed = [self.model, base, self._embed, self._rotary, self._norm, head, *self._layers]
        self._hook_dicts = [d for m in bypassed for d in (m._forward_hooks, m._forward_pre_hooks)]

    def _blocked(self) -> bool:
        config = self._config
        return (self.reference or not self._applies or torch.compiler.is_compiling()
                or bool(_global_forward_hooks or _global_forward_pre_hooks) or any(self._hook_dicts)
                or any(getattr(config, k, False) for k in _OUTPUT_FLAGS))

    def logits(self, input_ids: torch.Tensor, cache, cache_kw: str,
               embedded: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits [1, 1, V] of the one token ``input_ids`` [1, 1] after the tokens in ``cache`` (a
        DynamicCache, which gets the token's keys/values), or None where the step does not apply
        (module docstring; the caller then runs ``model(...)``).

        Args:
            cache_kw: the keyword the decoder layers take the cache by (``cache`` or ``past_key_values``).
            embedded: the token's embedding row [1, H] or [1, 1, H] when already looked up.
        """
        from transformers.cache_utils import DynamicCache

        if input_ids.shape != (1, 1) or type(cache) is not DynamicCache or self._blocked():
            return None
        self.calls += 1
        h = self._embed.forward(input_ids) if embedded is None else embedded.reshape(1, 1, -1)  # [1, 1, H]
        past = cache.get_seq_length()
        position_ids = (torch.arange(1, device=h.device) + past).unsqueeze(0)  # [1, 1]
        position_embeddings = self._rotary.forward(h, position_ids)
        kwargs = {"attention_mask": None, "position_ids": position_ids, cache_kw: cache, "use_cache": True,
                  "position_embeddings": position_embeddings}
        for layer in self._layers:
            h = layer.forward(h, **kwargs)
            if isinstance(h, tuple):  # an older decoder layer's (hidden, ...) output
                h = h[0]
        return self._head.forward(self._norm.forward(h))  # [1, 1, V]


def install_model_step(model: nn.Module) -> ModelStep:
    """The one-token forward of ``model`` (module docstring); it applies only where it can."""
    return ModelStep(model)
