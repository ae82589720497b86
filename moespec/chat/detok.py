"""Incremental detokenisation: text pieces from a growing list of token ids.

Byte-level tokenizers can split one UTF-8 character over several tokens; decoding a prefix
then ends in U+FFFD. The decoder holds such a tail back until the character is complete, so
every piece it returns is final and the pieces concatenate to ``decode(all ids)``. Used by
ChatSession.send and the server (moespec/serve), so both stream the same text.
"""

from __future__ import annotations


class IncrementalDecoder:
    """Turns token ids, one at a time, into text pieces.

    Args:
        tokenizer: a transformers tokenizer.
        skip_special_tokens: drop special tokens from the text (False keeps them: tool-call markers).
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.shown = ""

    def push(self, token_id: int) -> str:
        """Add one token; returns the new final text ("" while a character is incomplete)."""
        self.ids.append(token_id)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
        if full.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        piece = full[len(self.shown):]
        self.shown = full
        return piece

    def flush(self) -> str:
        """The text held back at the end (an incomplete character decodes as U+FFFD)."""
        full = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
        piece = full[len(self.shown):] if len(full) > len(self.shown) else ""
        self.shown = full
        return piece
