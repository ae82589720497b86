"""Grammar-constrained decoding through llguidance: a token mask per step from a JSON schema or
a Lark grammar.

Shapes: V vocabulary (the model's logits length), W = ceil(V / 32) mask words.

Why llguidance (moespec[serve]): a dependency-free wheel (xgrammar pulls triton, a GPU compiler,
onto CPU installs), a parser built in milliseconds where outlines-core compiles a token index
for seconds (0.9 s for a small schema, 35 s for "any JSON object" on a 49k vocabulary), and a
mask in ~0.2 ms per token computed lazily (README, "Structured output"). llguidance's own
``apply_token_bitmask_inplace`` is a torch.compile kernel; the mask here is unpacked with numpy.

A ``GrammarCompiler`` belongs to one tokenizer: it wraps the tokenizer for llguidance once
(about 2 s for a 49k vocabulary) and compiles each grammar once (a small LRU keyed by the
grammar text); a generation gets a ``GrammarConstraint``, a copy of the compiled matcher.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import numpy as np
import torch

from moespec.errors import MoespecError

# Compact JSON with json.dumps' spacing: real models write it, and a random model cannot spin
# in whitespace forever (llguidance's default allows any run of whitespace between tokens).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(MoespecError):
    """A schema or grammar that does not compile (the message says why)."""


def json_schema_grammar(schema: dict) -> str:
    """The llguidance grammar text for JSON values matching ``schema``.

    Raises:
        GrammarError: ``schema`` is not a JSON object.
    """
    import llguidance

    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"the JSON schema is invalid: {exc}") from None


def lark_grammar(lark: str) -> str:
    """The llguidance grammar text of a Lark grammar (``%json {...}`` embeds a JSON schema)."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(lark)


class GrammarCompiler:
    """Compiles grammars for one tokenizer, each grammar once.

    Args:
        tokenizer: a fast transformers tokenizer.
        vocab_size: V, the model's logits length (may exceed the tokenizer's: padded rows).
        stop_ids: ids that end an answer; a finished grammar allows only these.
        cache_size: compiled grammars kept (least recently used dropped first).
    """

    def __init__(self, tokenizer, vocab_size: int, stop_ids: set[int], cache_size: int = 64) -> None:
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        self.cache_size = cache_size
        self.compiled = 0  # grammars compiled so far (a cache hit does not count)
        self._tok = None
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()

    def tokenizer(self):
        """The llguidance tokenizer (built on first use)."""
        if self._tok is None:
            import llguidance.hf

            self._tok = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size,
                                                     eos_token=self.stop_ids or None)
        return self._tok

    def compile(self, grammar: str) -> object:
        """The compiled matcher of ``grammar`` (llguidance grammar text), from the cache when seen.

        Raises:
            GrammarError: the grammar does not compile (llguidance's message).
        """
        import llguidance

        with self._lock:
            if grammar in self._cache:
                self._cache.move_to_end(grammar)
                return self._cache[grammar]
            matcher = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
            if matcher.is_error():
                raise GrammarError(_one_line(matcher.get_error()))
            self.compiled += 1
            self._cache[grammar] = matcher
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return matcher

    def constraint(self, grammar: str) -> "GrammarConstraint":
        """A fresh GrammarConstraint of ``grammar`` for one generation."""
        return GrammarConstraint(self.compile(grammar).deep_copy(), self.vocab_size)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for (a special token: its name)."""
        return self.tokenizer().decode_bytes([token_id])


class GrammarConstraint:
    """The grammar state of one generation: masks logits, follows the sampled tokens.

    Args:
        matcher: an llguidance LLMatcher of its own (a copy of the compiled one).
        vocab_size: V.
    """

    def __init__(self, matcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size

    def _allowed_np(self) -> np.ndarray:
        words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)  # [4 W]
        return np.unpackbits(words, bitorder="little")[:self.vocab_size].view(np.bool_)  # [V]

    def allowed(self) -> torch.Tensor:
        """Bool [V]: the tokens the grammar allows next (llguidance's bitmask, little-endian bits)."""
        return torch.from_numpy(self._allowed_np())

    def allowed_reference(self) -> torch.Tensor:
        """The same mask as ``allowed`` decoded one bit at a time (the slow reference)."""
        raw = self.matcher.compute_bitmask()
        return torch.tensor([bool(raw[i // 8] >> (i % 8) & 1) for i in range(self.vocab_size)])

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [V] (float32, on the host) with every token the grammar forbids set to -inf.

        numpy, single-threaded: torch splits a 49k-element op over its intra-op threads, which
        on a busy host cost 10+ ms a token where this costs ~0.1 ms.
        """
        z = logits.numpy()  # [V] float32, shares memory
        return torch.from_numpy(np.where(self._allowed_np(), z, np.float32(-np.inf)))

    def accept(self, token_id: int) -> None:
        """Advance past the sampled ``token_id`` (one the mask allowed).

        Raises:
            GrammarError: the grammar refused it (a bug: the mask allowed only valid tokens).
        """
        if not self.matcher.consume_token(int(token_id)):
            raise GrammarError(f"the grammar refused token {token_id}: {_one_line(self.matcher.get_error())}")

    @property
    def finished(self) -> bool:
        """True once the grammar is complete (only a stop token may follow)."""
        return self.matcher.is_stopped() or self.matcher.is_accepting()


def _one_line(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= 300 else text[:297] + "..."
