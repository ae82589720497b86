"""Decode steps and prefill tokens per multiple-choice item, counted from the tokens alone (no model run).

    python scripts/eval_steps.py --tasks arc_easy,boolq,sciq,winogrande --limit 200 --first 3

Per task, over the first --limit items (and over the first --first, the items a short timed run
scores, to scale its times to the whole table): the decode steps of the shared-prefix scorer
(speculative and exact-decode arms: eval/shared_prefix.py) and of the one-choice-at-a-time scorer
(guarded: eval/score.DecodeScorer), both counting the context's last token, and the tokens of the
item's shared context prefill. Tokenises with the default model's tokenizer as lm-eval does
(eval/score.encode_pair). The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json


def steps(pairs) -> tuple[int, int, int]:
    """(shared-prefix decode steps, one-at-a-time decode steps, prefill tokens) of one item."""
    from moespec.eval.score import decode_prefix, shared_length

    n = shared_length(pairs)
    if n == 0:
        parts = [steps([p]) for p in pairs]
        return tuple(sum(x) for x in zip(*parts))  # type: ignore[return-value]
    fulls = [c + t for c, t in pairs]
    one_by_one = sum(len(f) - 1 - n for f in fulls) + 1  # each choice's inputs, + the context's last token
    seen = {tuple(f[n:end]) for f in fulls for end in range(n + 1, len(f))}  # distinct decoded prefixes
    return len(seen) + 1, one_by_one, len(decode_prefix(pairs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="arc_easy,boolq,sciq,winogrande")
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--first", type=int, default=3)
    args = ap.parse_args()

    from moespec.eval.data import ChoiceItem, load_task
    from moespec.eval.score import encode_pair
    from moespec.eval.tasks import resolve_tasks
    from moespec.default_model import ensure_default_model
    from moespec.model_check import load_tokenizer

    tokenizer = load_tokenizer(ensure_default_model(None), "auto")
    out = {}
    for spec in resolve_tasks(args.tasks, None):
        items = [it for it in load_task(spec.name, spec.path).items[: args.limit] if isinstance(it, ChoiceItem)]
        rows = [steps([encode_pair(tokenizer, c, t) for c, t in zip(it.contexts, it.continuations)]) for it in items]
        mean = lambda rs, k: sum(r[k] for r in rs) / max(len(rs), 1)  # noqa: E731
        head = rows[: args.first]
        out[spec.name] = {"items": len(rows), "shared_steps": mean(rows, 0), "decode_steps": mean(rows, 1),
                          "prefill_tokens": mean(rows, 2), "first_shared_steps": mean(head, 0),
                          "first_decode_steps": mean(head, 1), "first_prefill_tokens": mean(head, 2)}
        o = out[spec.name]
        print(f"{spec.name:11s} {len(rows)} items: steps {o['shared_steps']:.2f} shared / {o['decode_steps']:.2f} "
              f"one by one, prefill {o['prefill_tokens']:.0f} tok | first {len(head)}: {o['first_shared_steps']:.2f}"
              f" / {o['first_decode_steps']:.2f}, {o['first_prefill_tokens']:.0f} tok")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
