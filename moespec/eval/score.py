"""Log-likelihood of answer choices through the DECODE path, so every execution mode acts on it.

Shapes: V vocabulary.

Prefill is always exact (runtime/moe_layer.py): a choice scored from a prefill's logits is the same
in every mode. So each scored token's log-probability comes from a one-token decode step:

    shared context  c_0 .. c_{n-2} | c_{n-1}        choice i: t_0 .. t_{m-1}
                    prefill, once  | decode, once   decode t_0 .. t_{m-2}, one token per step
                                   '-> logits scoring t_0 of every choice

The n - 1 context tokens are prefilled once per item, its last token is decoded once; each choice
then decodes its own tokens and the KV cache is cut back to the n shared tokens before the next
(Engine.truncate). When the choices' contexts differ (WinoGrande puts the option in the context),
n is their common token prefix, and the rest of each context is decoded without being scored. An
item with C choices costs one prefill, not C (``DecodeScorer.prefills`` counts them).

``PrefillScorer`` is exact mode's fast path: the same context prefill, then each choice's tokens in
one forward with all their logits. It equals the decode path in exact mode only (both are tested
against transformers), and reads the weights once per choice instead of once per token.

Tokenisation is lm-evaluation-harness's (``HFLM.tok_encode`` / ``TemplateLM._encode_pair``): the
context's trailing spaces move to the continuation, the whole string is encoded and the context's
tokens split off, an empty context becomes the prefix token (BOS, else EOS). ``prefill_logprob`` is
the slow reference: one prefill from scratch per scored token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from moespec.runtime.engine import common_prefix


@dataclass(frozen=True)
class ChoiceScore:
    """One choice: Σ log p(continuation token) in nats, and whether every token was the argmax."""

    logprob: float
    greedy: bool


def prefix_token_id(tokenizer) -> int:
    """The token an empty context becomes: BOS, else EOS (lm-eval's ``HFLM.prefix_token_id``)."""
    return tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id


def encode(tokenizer, text: str) -> list[int]:
    """``text`` as lm-eval's HF model encodes it: the tokenizer's own special tokens, except none when
    the text already starts with the prefix token's text."""
    bos = tokenizer.decode(prefix_token_id(tokenizer))
    kwargs = {"add_special_tokens": False} if bos and text.startswith(bos) else {}
    return list(tokenizer.encode(text, **kwargs))


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) of one request, split as lm-eval splits them.

    Raises:
        ValueError: the continuation encodes to no token.
    """
    if not context:
        cont = list(tokenizer.encode(continuation, add_special_tokens=False))
        prefix = prefix_token_id(tokenizer)
        ctx, cont = ([prefix], cont) if not cont or cont[0] != prefix else (cont[:1], cont[1:])
    else:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = encode(tokenizer, context + continuation)
        ctx = encode(tokenizer, context)
        cont = whole[len(ctx):]
    if not cont:
        raise ValueError(f"the continuation {continuation!r} encodes to no token")
    return ctx, cont


def prefill_exact(engine, ids: list[int]) -> torch.Tensor:
    """``engine.prefill(ids)`` (logits [V] at the last position) with at least two tokens in the forward.

    A forward of ONE token runs the runner's decode path, where speculative and guarded modes act: the
    position it caches would not be exact, yet every later item and arm reuses cached positions as
    exact (a WinoGrande twin sharing all but the last token of the item before's context did so).
    So when all but one of ``ids`` (or all) are cached, the cache is cut back to leave two to run.
    A one-token ``ids`` still runs alone.
    """
    leave_two(engine, ids)
    return engine.prefill(ids)


def leave_two(engine, ids: list[int]) -> None:
    """Cut the KV cache back so that a prefill of ``ids`` runs at least two tokens (prefill_exact)."""
    if len(ids) > 1 and common_prefix(engine.cached_ids, ids) >= len(ids) - 1:
        engine.truncate(len(ids) - 2)


def decode_prefix(pairs: Sequence[tuple[list[int], list[int]]]) -> list[int]:
    """The tokens ``DecodeScorer`` prefills for an item: the shared context less its last token
    ([] when the choices share no first token, or only one)."""
    n = shared_length(pairs)
    return list(pairs[0][0][: n - 1]) if n > 1 else []


def shared_length(pairs: Sequence[tuple[list[int], list[int]]]) -> int:
    """Tokens every choice's context starts with: the common prefix of the contexts + continuations,
    at most the shortest context (a continuation token is always scored from a decode step)."""
    fulls = [c + t for c, t in pairs]
    limit = min(len(c) for c, _ in pairs)
    n = 0
    while n < limit and all(f[n] == fulls[0][n] for f in fulls):
        n += 1
    return n


class DecodeScorer:
    """Scores the choices of one item on ``engine`` (module docstring).

    Attributes:
        prefills: context prefills run so far (one per item; one more after a KV cut that failed).
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.prefills = 0

    def score(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[ChoiceScore]:
        """Log-likelihood of each (context ids, continuation ids) pair, in order.

        Afterwards the KV cache holds only prefilled positions (the shared context less its last
        token): what the next item may reuse never came from an approximate decode step.
        """
        n = shared_length(pairs)
        if n == 0:  # no common first token: each choice is its own item
            return [s for p in pairs for s in self.score([p])]
        fulls = [c + t for c, t in pairs]
        first = self._context(fulls[0][:n])
        out = []
        for i, (full, (ctx, _)) in enumerate(zip(fulls, pairs)):
            if i and not self.engine.truncate(n):
                first = self._context(fulls[0][:n])  # a layer could not be cut: run the context again
            out.append(self._choice(full, len(ctx), n, first))
        self.engine.truncate(self._exact_prefix(n))
        return out

    def _exact_prefix(self, n: int) -> int:
        """Cached positions that came from a prefill (DecodeScorer decodes the context's last token)."""
        return n - 1

    def _context(self, ids: list[int]) -> torch.Tensor:
        """Prefill ``ids`` less its last token, decode that one; its logits [V] score every choice's first token.

        The prefill is skipped when the KV cache holds exactly those tokens already (another arm of
        the same item prefilled them: eval/run.py); they came from a prefill either way, which is
        exact in every mode.
        """
        if len(ids) > 1:
            if self.engine.cached_ids != ids[:-1]:
                prefill_exact(self.engine, ids[:-1])
                self.prefills += 1
        else:
            self.engine.reset()
        return self.engine.forward(ids[-1:], "decode")

    def _choice(self, full: list[int], ctx_len: int, start: int, logits: torch.Tensor) -> ChoiceScore:
        """Decode ``full`` from position ``start`` on; sum the log-probabilities of positions >= ctx_len."""
        total, greedy = 0.0, True
        for pos in range(start, len(full)):
            if pos > start:
                logits = self.engine.forward([full[pos - 1]], "decode")  # [V], predicts full[pos]
            if pos >= ctx_len:
                total += float(torch.log_softmax(logits, dim=-1)[full[pos]])
                greedy = greedy and int(torch.argmax(logits)) == full[pos]
        return ChoiceScore(total, greedy)


class PrefillScorer(DecodeScorer):
    """Exact mode's fast path: the shared context prefilled whole, then each choice's tokens in ONE
    forward with every position's logits (the weights are read once per choice, not once per token).

    Prefill is exact in every mode, so this path is for ``exact`` only, where it equals the decode path
    (tested within 1e-4 in float32); the KV cache is cut back between choices as in DecodeScorer.
    """

    def _context(self, ids: list[int]) -> torch.Tensor:
        self.prefills += 1
        return prefill_exact(self.engine, ids)  # [V] at the context's last position

    def _exact_prefix(self, n: int) -> int:
        return n

    def _choice(self, full: list[int], ctx_len: int, start: int, logits: torch.Tensor) -> ChoiceScore:
        rows = [logits]  # row j predicts full[start + j]
        if len(full) - 1 > start:
            rows.extend(self.engine.forward(full[start:-1], "prefill", all_logits=True).unbind(0))  # [T, V]
        return summed(rows, full, ctx_len, start)


def summed(rows: Sequence[torch.Tensor], full: list[int], ctx_len: int, start: int) -> ChoiceScore:
    """Σ log p(full[pos]) over positions pos >= ctx_len, each from rows[pos - start] (logits [V]
    predicting full[pos]), summed in position order; greedy when every one is the row's argmax."""
    total, greedy = 0.0, True
    for pos in range(max(start, ctx_len), len(full)):
        row = rows[pos - start]
        total += float(torch.log_softmax(row, dim=-1)[full[pos]])
        greedy = greedy and int(torch.argmax(row)) == full[pos]
    return ChoiceScore(total, greedy)


def prefill_logprob(engine, ctx: list[int], cont: list[int]) -> ChoiceScore:
    """The slow reference of ``DecodeScorer``: each continuation token scored from the last position of
    a prefill of everything before it, from scratch (``len(cont)`` prefills)."""
    full = ctx + cont
    total, greedy = 0.0, True
    for pos in range(len(ctx), len(full)):
        engine.reset()
        logits = engine.prefill(full[:pos])  # [V], predicts full[pos]
        total += float(torch.log_softmax(logits, dim=-1)[full[pos]])
        greedy = greedy and int(torch.argmax(logits)) == full[pos]
    return ChoiceScore(total, greedy)
