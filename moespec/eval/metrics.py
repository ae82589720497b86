"""Per-item metrics, as lm-evaluation-harness computes them.

Multiple choice (lm-eval ``Task.process_results``, output_type multiple_choice): ``acc`` is 1 when
the highest summed log-likelihood is the gold choice; ``acc_norm`` divides each log-likelihood by
its choice's length in characters first. lm-eval's choice text is the continuation without its
target delimiter (one leading space), so that is what is counted here.

GSM8K (lm-eval ``gsm8k-cot.yaml``): the answer is extracted from the generated text by regex and
compared by ``exact_match`` with ``ignore_case`` and ``regexes_to_ignore`` [",", "\\$", "(?s).*#### ",
"\\.$"] applied to both sides. ``flexible-extract`` takes the last number in the text; ``strict-match``
takes the number after "the answer is" (lm-eval's pattern has a capital T; olmo-eval's 8-shot prompt,
which moespec's GSM8K uses, writes "So the answer is", so either case is accepted here).
"""

from __future__ import annotations

import re
from typing import Sequence

FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
STRICT = re.compile(r"[Tt]he answer is (\-?[0-9\.\,]+).")
IGNORE = (",", r"\$", r"(?s).*#### ", r"\.$")
FALLBACK = "[invalid]"


def choice_metrics(logprobs: Sequence[float], continuations: Sequence[str], gold: int) -> dict[str, float]:
    """{"acc", "acc_norm"} of one item from its choices' summed log-likelihoods (nats)."""
    pred = max(range(len(logprobs)), key=lambda i: (logprobs[i], -i))  # first maximum, as numpy's argmax
    lengths = [float(len(c[1:] if c.startswith(" ") else c)) or 1.0 for c in continuations]
    normed = [lp / n for lp, n in zip(logprobs, lengths)]
    pred_norm = max(range(len(normed)), key=lambda i: (normed[i], -i))
    return {"acc": float(pred == gold), "acc_norm": float(pred_norm == gold)}


def extract(text: str, pattern: re.Pattern, last: bool) -> str:
    """lm-eval's RegexFilter: the first (``last``: the last) match's first non-empty group, stripped."""
    found = pattern.findall(text)
    if not found:
        return FALLBACK
    match = found[-1 if last else 0]
    if isinstance(match, tuple):
        match = next((m for m in match if m), FALLBACK)
    return match.strip()


def normalise(text: str) -> str:
    """One side of lm-eval's exact_match as gsm8k-cot configures it."""
    for pattern in IGNORE:
        text = re.sub(pattern, "", text)
    return text.lower()


def generate_metrics(text: str, answer: str) -> dict[str, float | str]:
    """{"exact_match,flexible-extract", "exact_match,strict-match"} of one generated answer, and what
    each extraction found (kept in the per-item record)."""
    flexible = extract(text, FLEXIBLE, last=True)
    strict = extract(text, STRICT, last=False)
    want = normalise(answer)
    return {"exact_match,flexible-extract": float(normalise(flexible) == want),
            "exact_match,strict-match": float(normalise(strict) == want),
            "extracted": flexible}
