"""The one deterministic token trace every strategy runs, and the `exact` run that defines it.

Shapes: P prompt tokens, N decode steps, V vocabulary, K top-k.

The prompt comes from ``--data`` (or moespec's held-out text, or a short built-in text), cut
to P tokens. The `exact` run (true router, every missing expert fetched) prefills it and then
decodes N steps; its inputs become the decode inputs of every strategy (teacher forcing), so
each strategy sees identical inputs and its logits can be compared step by step with the exact
run's. The inputs are the exact run's greedy tokens (``DecodeInputs.GREEDY``) or the text's own
next N tokens (``DecodeInputs.TEXT``: held-out text, so perplexity means what it usually means).
Step i's target (the token its logits are scored on, for perplexity) is the next input: the exact
run's greedy choice, or the text's next token. The exact run also records the routing of every
MoE layer at every decode step: the `oracle` strategy replays it.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from moespec.config import ExecuteMode, OnMiss
from moespec.errors import DataError, PromptError
from moespec.models.base import Routing
from moespec.predict.base import NoPredictor
from moespec.runtime.layer.policy import LayerPolicy
from moespec.runtime.stats import NullRecorder

# Used only when neither --data nor moespec's shipped text is available.
BUILTIN_TEXT = (
    "The history of computing is a history of moving data. Processors became fast long before "
    "memories became large, and every generation of machines has had to decide what to keep close "
    "and what to fetch from far away. Caches, prefetchers and pipelines all answer the same "
    "question: what will be needed next, and can it arrive before it is needed? "
)


class DecodeInputs(str, enum.Enum):
    """What the decode steps are teacher-forced on (``profile --decode-inputs``)."""

    GREEDY = "greedy"  # the exact run's greedy tokens
    TEXT = "text"  # the text's tokens after the prompt


@dataclass
class TokenTrace:
    """Inputs and reference outputs shared by every strategy.

    Attributes:
        prompt: P prompt token ids.
        decode: N decode inputs: the exact run's greedy tokens (teacher forcing).
        logits: [N, V] float32 logits of the exact run's decode steps (the quality reference).
        routings: per decode step, layer -> the routing the exact run ran with (ids/weights [1, K]).
        source: where the prompt came from, in words.
        targets: N token ids the decode steps are scored on (step i's next input; see the module).
    """

    prompt: list[int]
    decode: list[int]
    logits: torch.Tensor
    routings: list[dict[int, Routing]]
    source: str
    targets: list[int] = field(default_factory=list)

    def sha256(self) -> str:
        """Fingerprint of the token ids (prompt + decode inputs)."""
        return token_sha256(self.prompt, self.decode)


def token_sha256(prompt: list[int], decode: list[int]) -> str:
    """sha256 of the token ids fed to a run (prefill ids, then decode ids)."""
    text = ",".join(map(str, prompt)) + "|" + ",".join(map(str, decode))
    return hashlib.sha256(text.encode()).hexdigest()


def load_text(data: str | None) -> tuple[str, str]:
    """(text, description) from ``--data``, moespec's held-out text, or the built-in text.

    Raises:
        DataError: ``--data`` is missing, unreadable or empty.
    """
    if data is not None:
        path = Path(data)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise DataError(f"--data {data}: cannot read it ({exc})", "pass a UTF-8 text file") from None
        if not text.strip():
            raise DataError(f"--data {data} is empty", "pass a text file with some text in it")
        return text, f"file {path.name}"
    try:
        from moespec.data import heldout_text

        return heldout_text(), "moespec held-out text"
    except (ImportError, AttributeError):
        return BUILTIN_TEXT, "built-in text"


def prompt_tokens(tokenizer, text: str, length: int, vocab_size: int, seed: int) -> list[int]:
    """The first ``length`` token ids of ``text`` (repeated if too short).

    Without a tokenizer: ``length`` ids drawn from a generator seeded with ``seed``.
    """
    if tokenizer is None:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab_size, (length,), generator=gen).tolist()
    chars = max(length * 8, 256)
    while True:
        ids = tokenizer(text[:chars], add_special_tokens=False)["input_ids"]
        if not ids:
            raise DataError("the prompt text produced no tokens with this model's tokenizer",
                            "pass another --data file, or check the model's tokenizer files")
        if len(ids) >= length:
            break
        if chars >= len(text):  # the whole text is shorter than the prompt: repeat it
            ids = ids * (length // len(ids) + 1)
            break
        chars *= 2
    return ids[:length]


def check_lengths(prompt_lens: list[int], gen: int, max_context: int) -> None:
    """Raises PromptError when a prompt plus its decode steps exceeds the model's context."""
    for p in prompt_lens:
        if p < 1:
            raise PromptError(f"--prompt-len {p} must be at least 1")
        if p + gen + 1 > max_context:
            raise PromptError(f"--prompt-len {p} plus --gen {gen} is beyond the model's context of {max_context} tokens",
                              f"use --prompt-len {max(1, max_context - gen - 1)} or less")


def cold_start(om, engine, policy: LayerPolicy) -> None:
    """Same start for every run: empty KV cache, no prefetch pins, empty expert cache; then ``policy``."""
    engine.reset()
    om.reset_step()
    om.use_policy(policy)
    om.cache.clear()


def record_trace(om, engine, prompt: list[int], gen: int, source: str,
                 forced: list[int] | None = None) -> TokenTrace:
    """Run `exact` over ``prompt`` for ``gen`` decode steps and record the trace.

    ``forced``: gen + 1 text token ids after the prompt: step i is fed ``forced[i]`` and scored on
    ``forced[i + 1]``; None decodes greedily (each step scored on the exact run's next greedy token).
    """
    cold_start(om, engine, replace(om.policy, predictor=NoPredictor(om.adapter, om.layer_refs()),
                                   execute=ExecuteMode.EXACT, on_miss=OnMiss.FETCH))
    saved_recorder = om.recorder
    om.set_recorder(NullRecorder())
    decode, logits, routings = [], [], []
    try:
        with om.recording_routings() as ran:
            last = engine.forward(prompt, "prefill")  # [V]
            for i in range(gen):
                tok = int(torch.argmax(last)) if forced is None else forced[i]
                decode.append(tok)
                last = engine.forward([tok], "decode")
                logits.append(last.cpu())
                routings.append({layer: Routing(ids=r.ids.clone(), weights=r.weights.clone())
                                 for layer, r in ran.items()})
    finally:
        om.set_recorder(saved_recorder)
    stacked = torch.stack(logits)  # [N, V]
    targets = list(forced[1 : gen + 1]) if forced is not None else torch.argmax(stacked, dim=-1).tolist()
    return TokenTrace(prompt=list(prompt), decode=decode, logits=stacked, routings=routings, source=source,
                      targets=targets)
