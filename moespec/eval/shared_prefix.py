"""Choices that share leading tokens decode those tokens once: the decode path over a prefix tree.

Shapes: V vocabulary.

``DecodeScorer`` decodes each choice's tokens after the shared context from scratch (the KV cache cut
back to the context between choices). ARC's " a cell wall" and " a cell membrane" decode " a" and
" cell" twice there. ``SharedPrefixScorer`` visits the choices in token order and cuts the KV cache
back only to the longest prefix the next choice shares with the tokens decoded so far, so every
distinct prefix is decoded once (on the vendored items: ARC-Easy 12.6 -> 11.2 decode steps per item,
SciQ 4.2 -> 3.9; BoolQ and WinoGrande share nothing past their contexts).

It equals ``DecodeScorer`` only where a decode step's output depends on nothing but the cached
keys/values and its token: ``exact`` and ``speculative`` (a speculated expert that is not resident is
fetched; residency changes timing, never the output; with ``--on-miss host|auto`` where a miss
runs is a timed choice in either scorer). In ``guarded`` mode the resident experts
decide what a light miss runs, and decoding fewer tokens changes what is resident, so guarded
arms keep ``DecodeScorer`` (``scorer_for``). Tested against ``DecodeScorer`` within 1e-5 (float32) on
every architecture's tiny model.
"""

from __future__ import annotations

from typing import Sequence

from moespec.config import ExecuteMode
from moespec.eval.score import ChoiceScore, DecodeScorer, PrefillScorer, shared_length, summed
from moespec.runtime.engine import common_prefix


class SharedPrefixScorer(DecodeScorer):
    """``DecodeScorer`` that decodes a prefix shared by several choices once (module docstring).

    Attributes:
        prefills: as DecodeScorer's.
        decode_steps: one-token decode steps run after the contexts so far (the work it saves).
    """

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.decode_steps = 0

    def score(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[ChoiceScore]:
        """Log-likelihood of each (context ids, continuation ids) pair, in the order given; the KV
        cache is left as DecodeScorer leaves it (only prefilled positions)."""
        n = shared_length(pairs)
        if n == 0:
            return [s for p in pairs for s in self.score([p])]
        fulls = [c + t for c, t in pairs]
        rows = [self._context(fulls[0][:n])]  # rows[j]: logits [V] predicting position n + j
        path: list[int] = []  # tokens decoded after the n shared ones; their keys/values are cached
        out: list[ChoiceScore | None] = [None] * len(pairs)
        for i in sorted(range(len(pairs)), key=lambda j: fulls[j][n:]):  # neighbours share the most
            inputs = fulls[i][n:-1]  # the tokens this choice decodes (its last one is only scored)
            k = common_prefix(path, inputs)
            if k < len(path):
                if self.engine.truncate(n + k):
                    del path[k:], rows[k + 1:]
                else:  # a layer could not be cut: run the context again
                    rows, path, k = [self._context(fulls[0][:n])], [], 0
            for tok in inputs[k:]:
                rows.append(self.engine.forward([tok], "decode"))
                path.append(tok)
                self.decode_steps += 1
            out[i] = summed(rows, fulls[i], len(pairs[i][0]), n)  # DecodeScorer's float sum
        self.engine.truncate(self._exact_prefix(n))
        return out  # type: ignore[return-value]


def scorer_for(engine, execute: ExecuteMode, exact_path: str = "prefill") -> DecodeScorer:
    """The scorer an arm uses: exact with ``exact_path`` "prefill" PrefillScorer, guarded the plain
    DecodeScorer (its outputs depend on residency), every other arm SharedPrefixScorer."""
    if execute == ExecuteMode.EXACT and exact_path == "prefill":
        return PrefillScorer(engine)
    if execute == ExecuteMode.GUARDED:
        return DecodeScorer(engine)
    return SharedPrefixScorer(engine)
