"""Exact-mode greedy generation checked against drafts: the other arms' texts, verified in one prefill.

Shapes: V vocabulary, D draft tokens checked in one forward.

Greedy generation is a chain of argmaxes: token n+1 is the argmax of the logits after tokens 0..n.
In exact mode a prefill computes those logits for every position at once (prefill is exact in every
mode, runtime/moe_layer.py), so a guess of the next D tokens is checked in ONE forward of D + 1
tokens: the guessed tokens are kept while each equals the argmax of the row before it, the first
one that differs is replaced by that argmax, and the KV cache is cut back to what was kept.
What comes out is the greedy text of the exact model; only the cost changes (one forward reads the
weights once for D tokens instead of D times).

The guesses are the texts the item's other arms generated before it (eval/run.py runs the exact
prefill-path arm last): a speculative or guarded arm that agreed with exact so far usually goes on
agreeing for a while. After the last draft stops agreeing the rest runs one decode step per token.

``drafted_greedy`` yields what ``Engine.generate`` with greedy sampling yields: the same tokens, the
same stop rules (a stop id is yielded then ends it, ``max_new`` tokens, the model's context); their
logits come from prefill rows instead of one-token forwards, which is float rounding (the exact
arm's choices are scored from prefill rows too, score.PrefillScorer). Tested against
``Engine.generate`` on tiny models with right, partly right and wrong drafts. Unlike
``Engine.generate``, a stop may leave checked draft tokens in the KV cache: the caller cuts it
back to the prompt (run.generate_text does).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

DRAFT_BLOCK = 32  # most draft tokens checked in one forward: a wrong first guess wastes at most this much


def _guess(drafts: Sequence[Sequence[int]], out: list[int], most: int) -> list[int]:
    """The next ``most`` tokens of the first draft that starts with ``out`` ([] when none does)."""
    n = len(out)
    for d in drafts:
        if len(d) > n and list(d[:n]) == out:
            return list(d[n:n + most])
    return []


def drafted_greedy(engine, ids: list[int], max_new: int, stop_ids: set[int], drafts: Sequence[Sequence[int]],
                   block: int = DRAFT_BLOCK) -> Iterator[int]:
    """Greedy tokens after prompt ``ids`` (exact mode), checking ``drafts`` (token id lists that continue
    ``ids``) ``block`` tokens per forward (module docstring).

    Raises:
        PromptError: empty prompt or prompt beyond the context (Engine.check_prompt).
    """
    engine.check_prompt(ids)
    limit = engine.om.max_context()
    logits = engine.prefill(ids)  # [V]
    out: list[int] = []
    while True:
        tok = int(torch.argmax(logits))
        out.append(tok)
        yield tok
        if tok in stop_ids or len(ids) + len(out) >= limit or len(out) == max_new:
            return
        # the guess stops one token short of every limit, so a kept guess never passes one unchecked
        room = min(block, max_new - len(out) - 1, limit - len(ids) - len(out) - 1)
        guess = _guess(drafts, out, room) if room > 0 else []
        if not guess:
            logits = engine.forward([tok], "decode")  # [V]
            continue
        rows = engine.forward([tok] + guess, "prefill", all_logits=True)  # [1 + D, V]; row j follows token j
        j = 0
        while j < len(guess) and int(torch.argmax(rows[j])) == guess[j]:
            out.append(guess[j])
            yield guess[j]
            if guess[j] in stop_ids:
                return
            j += 1
        if engine.truncate(len(ids) + len(out)):  # the prompt and every kept token: the guesses after go
            logits = rows[j]  # [V]: the logits after the last kept token
        else:  # a layer could not be cut (kv.py), so the cache was dropped: prefill what was kept
            logits = engine.prefill(ids + out)
