"""TokenControls: the per-generation logits processor (penalties, logit_bias, grammar, logprobs).

Shapes: V vocabulary.

OpenAI's definitions (the "Parameter details" of its API reference): with c[j] the times token j
was generated so far in this completion,
    logits[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty
and logit_bias adds its value (-100..100) to the token's logit. The grammar mask comes last, so
no bias can bring back a token the grammar forbids. With nothing asked, the Engine gets no
processor at all and greedy decoding stays bit-equal to `moespec chat`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from moespec.sampling.grammar import GrammarConstraint
from moespec.sampling.logprobs import TokenLogprob, token_logprob


@dataclass
class TokenControls:
    """Processes each step's logits and follows the sampled tokens.

    Call order per step: ``controls(logits)`` (the Engine, before sampling), then
    ``controls.accept(token)`` (the caller, with the token the Engine yielded).

    Attributes:
        vocab_size: V.
        presence_penalty, frequency_penalty: OpenAI's, in [-2, 2].
        logit_bias: token id -> bias added to its logit.
        grammar: a GrammarConstraint, or None.
        top_logprobs: alternatives to record per token; None records no logprobs.
        logprobs: what was recorded, one per accepted token.
    """

    vocab_size: int
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    grammar: Optional[GrammarConstraint] = None
    top_logprobs: Optional[int] = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    _counts: Optional[torch.Tensor] = field(default=None, repr=False)
    _bias: Optional[torch.Tensor] = field(default=None, repr=False)
    _last: Optional[torch.Tensor] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.presence_penalty or self.frequency_penalty:
            self._counts = torch.zeros(self.vocab_size)  # [V] float32: c[j]
        if self.logit_bias:
            self._bias = torch.zeros(self.vocab_size)  # [V]
            ids = torch.tensor(list(self.logit_bias), dtype=torch.long)
            self._bias[ids] = torch.tensor(list(self.logit_bias.values()), dtype=torch.float32)

    @property
    def active(self) -> bool:
        """False when the controls change nothing and record nothing (the Engine can skip them)."""
        return (self._counts is not None or self._bias is not None or self.grammar is not None
                or self.top_logprobs is not None)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits [V] (float32, moved to the host: 200 KB for a 49k vocabulary) to sample from."""
        z = logits.detach().float().cpu()
        if self._counts is not None:
            z = z - self._counts * self.frequency_penalty - (self._counts > 0).float() * self.presence_penalty
        if self._bias is not None:
            z = z + self._bias
        if self.grammar is not None:
            z = self.grammar.mask(z)
        self._last = z
        return z

    def accept(self, token_id: int) -> None:
        """The Engine sampled ``token_id`` from the last processed logits."""
        if self.top_logprobs is not None and self._last is not None:
            self.logprobs.append(token_logprob(self._last, token_id, self.top_logprobs))
        if self._counts is not None:
            self._counts[token_id] += 1
        if self.grammar is not None:
            self.grammar.accept(token_id)


def penalized_reference(logits: list[float], generated: list[int], presence: float, frequency: float,
                        bias: dict[int, float]) -> list[float]:
    """OpenAI's penalty and bias formula token by token in plain Python (the test reference)."""
    out = []
    for j, z in enumerate(logits):
        c = generated.count(j)
        out.append(z - c * frequency - (1.0 if c > 0 else 0.0) * presence + bias.get(j, 0.0))
    return out
