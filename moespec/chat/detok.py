"""Incremental detokenisation: text pieces from a growing list of token ids.

Byte-level tokenizers can split one UTF-8 character over several tokens; decoding a prefix
then ends in U+FFFD. The decoder holds such a tail back until the character is complete, so
every piece it returns is final and the pieces concatenate to ``decode(all ids)``. The same
rule as ChatSession.send, factored out for the server (see moespec/serve).
"""

from __future__ import annotations


class IncrementalDecoder:
    """Turns token ids, one at a time, into text pieces.

    Args:
        tokenizer: a transformers tokenizer (``decode`` with ``skip_special_tokens=True``).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.shown = ""

    def push(self, token_id: int) -> str:
        """Add one token; returns the new final text ("" while a character is incomplete)."""
        self.ids.append(token_id)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if full.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        piece = full[len(self.shown):]
        self.shown = full
        return piece

    def flush(self) -> str:
        """The text held back at the end (an incomplete character decodes as U+FFFD)."""
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        piece = full[len(self.shown):] if len(full) > len(self.shown) else ""
        self.shown = full
        return piece
