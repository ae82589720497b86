"""Engine: prefill + decode with a KV cache; speaks token ids only (nothing of text).

Shapes: V vocabulary, T tokens of one forward pass.

The KV cache is kept between calls. A conversation re-renders its whole history each turn; the
cached keys/values are reused as far as the new ids equal the cached ids (the common prefix) and
the rest is prefilled. Where the cache cannot be cut back to that prefix exactly (a sliding-window
layer past its window, an unknown cache layer class) the engine prefills from scratch: correct
first, then fast (moespec/runtime/kv.py says which layers can be cut).

A forward pass that ends in an exception (Ctrl-C, an error) leaves the runtime consistent: queued
copies are cancelled, every cache pin is dropped, and the KV cache is cut back to the tokens whose
forward finished (or dropped when it cannot be).
"""

from __future__ import annotations

import inspect
from typing import Callable, Iterator, Optional

import torch

from moespec.config import SamplingConfig
from moespec.errors import PromptError
from moespec.runtime import kv as kvcache
from moespec.runtime.model import OffloadedModel


def sample_next(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator) -> int:
    """Next token id from last-position logits [V]: greedy at temperature 0, else top-p sampling.

    Top-p keeps the smallest set of most likely tokens whose probability reaches ``top_p``.
    The logits are shifted so their maximum is 0 before dividing by the temperature: a tiny
    temperature then sends every other logit to -inf (greedy among the maxima), never to nan.
    """
    if sampling.temperature == 0:
        return int(torch.argmax(logits))
    z = logits.float()  # [V]
    scaled = (z - z.max()) / sampling.temperature  # [V], <= 0; the maxima stay exactly 0
    probs = torch.softmax(scaled, dim=-1)  # [V]
    if sampling.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        drop = torch.cumsum(sorted_p, dim=-1) - sorted_p >= sampling.top_p  # mass before this token
        sorted_p[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _cache_kwarg(model) -> str:
    """The forward's name for the KV cache: ``cache`` (transformers >= 5.2x) or ``past_key_values`` (5.17).

    5.24 still accepts ``past_key_values`` but logs a deprecation warning; 5.17 silently ignores
    ``cache`` (it would recompute without the history), so ask the signature.
    """
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


class Engine:
    """Generates token ids through an OffloadedModel.

    Args:
        om: the loaded model.
        reuse_kv: keep the cached prefix between calls (False: every prefill starts from scratch,
            the slow reference the reuse is tested against).

    Attributes:
        reused_tokens: prompt tokens of the last prefill whose keys/values came from the cache.
    """

    def __init__(self, om: OffloadedModel, reuse_kv: bool = True) -> None:
        self.om = om
        self.reuse_kv = reuse_kv
        self.reused_tokens = 0
        self._kv = None
        self._ids: list[int] = []  # tokens whose keys/values are in self._kv
        self._cache_kw = _cache_kwarg(om.model)

    @property
    def cached_ids(self) -> list[int]:
        """The token ids whose keys/values the KV cache holds (a copy)."""
        return list(self._ids)

    def reset(self) -> None:
        """Forget the KV cache (a new conversation)."""
        self._kv = None
        self._ids = []

    def check_prompt(self, ids: list[int], max_new_tokens: int = 0) -> None:
        """Raises PromptError for an empty prompt or one longer than the model's context."""
        if not ids:
            raise PromptError("the prompt is empty", "type some text (or pass --prompt TEXT)")
        limit = self.om.max_context()
        if len(ids) >= limit:
            raise PromptError(f"the prompt has {len(ids)} tokens; the model's context is {limit} tokens",
                              "shorten the prompt or start a new conversation (/reset)")

    @torch.inference_mode()
    def forward(self, new_ids: list[int], kind: str, reused: int = 0, all_logits: bool = False) -> torch.Tensor:
        """Run ``new_ids`` after the cached tokens; returns last-position logits [V] (float32), or with
        ``all_logits`` every new position's [T, V] (scoring a continuation in one pass).

        ``reused`` (prefill only) is recorded in the step's stats: cached prompt tokens not recomputed.
        On any exception (KeyboardInterrupt included) the runtime is left consistent (module
        docstring) and the exception propagates.
        """
        from transformers import DynamicCache

        om = self.om
        if self._kv is None:
            self._kv = DynamicCache(config=om.config)
            kvcache.record_past(self._kv)  # sliding-window layers stay cuttable (kv.py)
        om.reset_step(prefill=kind == "prefill")
        om.recorder.begin_step(kind, len(new_ids))
        inp = torch.tensor([new_ids], dtype=torch.long, device=om.device)  # [1, T]
        try:
            embedded = om.token_started(inp)  # a decode step's first MoE layer is prefetched from here (token_start.py)
            with om.threads.step(len(new_ids)):  # who runs where (runtime/threads.py)
                # one token: the lean whole-model step (runtime/decode_model.py), else transformers' forward
                lean = None if all_logits else om.one_token_logits(inp, self._kv, self._cache_kw, embedded)
                out = lean if lean is not None else om.model(
                    input_ids=inp, use_cache=True, logits_to_keep=0 if all_logits else 1,
                    **{self._cache_kw: self._kv}).logits
            logits = out[0].float() if all_logits else out[0, -1].float()  # [T, V] or [V]
        except BaseException:
            self.abort()
            raise
        step = om.recorder.end_step()
        step.reused_tokens = reused
        self._ids.extend(new_ids)
        return logits

    def abort(self) -> None:
        """Make the runtime consistent after an interrupted forward or generation (Ctrl-C).

        Cancels queued expert copies, drops every cache pin (OffloadedModel.abort) and cuts the KV
        cache back to the tokens whose forward finished (or drops it when a layer cannot be cut).
        Idempotent, and harmless between forwards: a second Ctrl-C may call it again.
        """
        self.om.abort()
        if self._kv is not None and not kvcache.truncate(self._kv, len(self._ids)):
            self.reset()  # some layer cannot be cut back: the next prefill starts from scratch

    def truncate(self, keep: int) -> bool:
        """Cut the KV cache back to its first ``keep`` tokens (scoring: back to the shared context
        between the choices of one question). Returns False, with the cache dropped (``reset``), when
        some layer cannot be cut exactly (kv.py): the caller runs the context again.
        """
        if keep >= len(self._ids):
            return True
        if self._kv is not None and keep > 0 and kvcache.truncate(self._kv, keep):
            del self._ids[keep:]
            return True
        self.reset()
        return False

    def prefill(self, ids: list[int]) -> torch.Tensor:
        """Prefill ``ids``, reusing the cached prefix they share with the cached tokens.

        Sets ``reused_tokens``. When nothing is shared, or the cache cannot be cut back to the
        shared prefix exactly, the old cache is dropped and ``ids`` run from scratch.
        """
        common = common_prefix(self._ids, ids) if self.reuse_kv else 0
        common = min(common, len(ids) - 1)  # at least one new token must run to produce logits
        if common < len(self._ids):
            if common == 0 or self._kv is None or not kvcache.truncate(self._kv, common):
                self.reset()
                common = 0
            else:
                del self._ids[common:]
        self.reused_tokens = common
        return self.forward(ids[common:], "prefill", reused=common)

    def generate(self, ids: list[int], sampling: SamplingConfig, stop_ids: set[int] = frozenset(),
                 logits_processor: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> Iterator[int]:
        """Yield up to ``sampling.max_new_tokens`` new token ids after prompt ``ids``.

        ``logits_processor`` (optional) maps each step's float32 logits [V] to the logits the token
        is sampled from (penalties, a grammar mask: moespec/sampling); it learns the sampled token
        from the caller, who receives every token before the next step runs. None: unchanged logits.

        Stops after yielding a token in ``stop_ids`` (it counts as generated, as in transformers
        ``generate``) or when the context is full. The last yielded token has not run through the
        model (its keys/values are not cached), so abandoning the generator between tokens leaves
        the cache consistent.

        Raises:
            PromptError: empty prompt or prompt beyond the context.
        """
        self.check_prompt(ids)
        gen = torch.Generator().manual_seed(sampling.seed)
        logits = self.prefill(ids)
        limit = self.om.max_context()
        for i in range(sampling.max_new_tokens):
            if logits_processor is not None:
                logits = logits_processor(logits)
            tok = sample_next(logits, sampling, gen)
            yield tok
            if tok in stop_ids or len(self._ids) + 1 >= limit or i + 1 == sampling.max_new_tokens:
                return
            logits = self.forward([tok], "decode")
