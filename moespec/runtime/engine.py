"""Engine: prefill + decode with a KV cache; speaks token ids only (nothing of text).

The KV cache is kept between calls: a new prompt that extends the previous conversation only
prefills the new tokens (multi-turn chat does not recompute the history).
"""

from __future__ import annotations

from typing import Iterator

import torch

from moespec.config import SamplingConfig
from moespec.errors import PromptError
from moespec.runtime.offload import OffloadedModel


def sample_next(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator) -> int:
    """Next token id from last-position logits [V]: greedy at temperature 0, else top-p sampling.

    Top-p keeps the smallest set of most likely tokens whose probability reaches ``top_p``.
    """
    if sampling.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)  # [V]
    if sampling.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        drop = torch.cumsum(sorted_p, dim=-1) - sorted_p >= sampling.top_p  # mass before this token
        sorted_p[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


class Engine:
    """Generates token ids through an OffloadedModel.

    Args:
        om: the loaded model.
    """

    def __init__(self, om: OffloadedModel) -> None:
        self.om = om
        self._kv = None
        self._ids: list[int] = []  # tokens whose keys/values are in self._kv

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
    def forward(self, new_ids: list[int], kind: str) -> torch.Tensor:
        """Run ``new_ids`` after the cached tokens; returns last-position logits [V] (float32)."""
        from transformers import DynamicCache

        om = self.om
        if self._kv is None:
            self._kv = DynamicCache(config=om.config)
        om.runner.reset_step()
        om.recorder.begin_step(kind, len(new_ids))
        inp = torch.tensor([new_ids], dtype=torch.long, device=om.device)  # [1, T]
        out = om.model(input_ids=inp, cache=self._kv, use_cache=True, logits_to_keep=1)
        logits = out.logits[0, -1].float()  # [V]
        om.recorder.end_step()
        self._ids.extend(new_ids)
        return logits

    def prefill(self, ids: list[int]) -> torch.Tensor:
        """Prefill ``ids``, reusing the cached prefix they share with the previous call."""
        common = 0
        for a, b in zip(self._ids, ids):
            if a != b:
                break
            common += 1
        common = min(common, len(ids) - 1)  # at least one new token must run to produce logits
        if self._kv is not None and common < len(self._ids):
            self._kv.crop(common)
            self._ids = self._ids[:common]
        return self.forward(ids[common:], "prefill")

    def generate(self, ids: list[int], sampling: SamplingConfig, stop_ids: set[int] = frozenset()) -> Iterator[int]:
        """Yield up to ``sampling.max_new_tokens`` new token ids after prompt ``ids``.

        Stops after yielding a token in ``stop_ids`` or when the context is full.

        Raises:
            PromptError: empty prompt or prompt beyond the context.
        """
        self.check_prompt(ids)
        gen = torch.Generator().manual_seed(sampling.seed)
        logits = self.prefill(ids)
        limit = self.om.max_context()
        for i in range(sampling.max_new_tokens):
            tok = sample_next(logits, sampling, gen)
            yield tok
            if tok in stop_ids or len(self._ids) + 1 >= limit or i + 1 == sampling.max_new_tokens:
                return
            logits = self.forward([tok], "decode")
