"""Log-probabilities of sampled tokens, from the float32 logits they were sampled from.

Shapes: V vocabulary, K top alternatives.

``log_softmax`` of the processed logits (penalties, bias and grammar mask applied; before the
temperature and top-p, as OpenAI reports them): the distribution the token came from at
temperature 1. Tokens a grammar forbids have logprob -inf and are never listed as alternatives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token's log-probability and the most likely alternatives at its step.

    Attributes:
        token_id: the sampled token.
        logprob: its natural-log probability (float32 arithmetic, <= 0).
        top: (token id, logprob) of the K most likely tokens, most likely first (K may be 0).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(logits: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    """The TokenLogprob of ``token_id`` under ``logits`` [V] (float32) with ``k`` alternatives.

    Raises:
        ValueError: ``k`` outside 0..MAX_TOP_LOGPROBS.
    """
    if not 0 <= k <= MAX_TOP_LOGPROBS:
        raise ValueError(f"k={k} must be in 0..{MAX_TOP_LOGPROBS}")
    lp = torch.log_softmax(logits.float(), dim=-1)  # [V]
    top: tuple[tuple[int, float], ...] = ()
    if k:
        values, ids = torch.topk(lp, k)  # [K], [K]
        top = tuple((int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist()) if v != float("-inf"))
    return TokenLogprob(int(token_id), float(lp[token_id]), top)
